"""The trial process's noise process: a step's Gaussian noise drawn ahead in a process of its
own, straight into a gradient buffer the two processes share.

Why a process and not a thread: a draw made on a thread beside the step takes Python's GIL
for a moment around each of its dozens of numpy and OpenSSL calls, and a step made of
hundreds of small torch calls (the mlp's: 2 ms) hands the GIL back and forth with it, each
hand-over a wake-up on the other core. On the 2-core reference machine a draw looping on a
thread slowed the mlp's DP step (its own noise off) by 1.33×, and the same draw looping in
another process by 1.02–1.07× (``docs/speed-history.md``). A process shares no GIL.

What the two share: the buffers made by :meth:`NoiseProcess.shared_zeros` (anonymous memory,
``memfd_create``, passed to the child as a file descriptor over a socket pair); for each draw,
the stream's key, where the keystream bytes the parent claimed for it start
(:func:`workers.gaussian.plan`) and the noise's standard deviation, so the child's draw is the
one the parent would have made, to the bit; and a control block (:class:`_Control`) from which
either process takes the draw's chunks, each once: the child from the front, the parent, when
it needs the noise before the child is done, from the back (whoever waits has nothing else to
do). The key never leaves the two processes: it goes over the socket pair, which nothing else
holds, and is never written anywhere. The child imports numpy and ``cryptography``, not torch
(it is ready in about 0.2 s; draws asked for before then are made on a thread), writes one
byte to wake the parent when the parent waits for a draw whose last chunk it has made or that
it failed, and exits when the parent's end of the socket closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from core.entropy import Keystream
from workers.gaussian import PIECE, Chunk, claim, make, plan

#: the child's program: serve the socket whose descriptor is its one argument
_SERVE = "import sys; from workers.noise_process import serve; serve(int(sys.argv[1]))"
#: the control block's fields, int64 each (:class:`_Control`)
FIELDS = 7
SERIAL, FRONT, BACK, MADE, FAILED, READY, WAITING = range(FIELDS)
#: the largest message to the child (a draw's is under 200 bytes)
MESSAGE = 1 << 12
#: the process that owns it, and its noise process
_current: tuple[int, NoiseProcess] | None = None


class NoiseProcessError(RuntimeError):
    """The noise process failed a draw, or is gone."""


class _Control:
    """Who makes which chunk of a draw, shared by the two processes: the draw being made (its
    serial), the next chunk from the front, where the chunks not taken end (those from there
    on were taken from the back), how many chunks are made, the last draw the child failed,
    whether the child has started, and the draw the parent waits for (the child wakes it
    then, and only then: wake-ups nobody reads would fill the socket, and a child blocked on
    one would read no more requests). Read and changed only under the POSIX record lock of
    its file, which each process holds open: such locks keep other processes out (and a
    threading lock keeps this process's threads apart). Serials start at 1, so the zeroed
    block matches no draw."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._fields = np.frombuffer(mmap.mmap(fd, 8 * FIELDS), dtype=np.int64)
        self._threads = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[np.ndarray]:
        with self._threads:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield self._fields
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def join(self, serial: int, chunks: int) -> None:
        """Begin making draw ``serial`` of ``chunks`` chunks, or join the other process in it.
        Serials only grow: a draw once replaced by a later one is never made again (a draw
        abandoned when a trial ended may reach the child after the next one began)."""
        with self._locked() as fields:
            if fields[SERIAL] < serial:
                fields[: MADE + 1] = serial, 0, chunks, 0

    def take(self, serial: int, *, front: bool) -> int | None:
        """A chunk of draw ``serial`` nobody has taken (None: none is left, or the draw was
        replaced)."""
        with self._locked() as fields:
            if fields[SERIAL] != serial or fields[FRONT] >= fields[BACK]:
                return None
            if front:
                fields[FRONT] += 1
                return int(fields[FRONT]) - 1
            fields[BACK] -= 1
            return int(fields[BACK])

    def made(self, serial: int, chunks: int) -> bool:
        """Count a chunk of draw ``serial`` made; whether that made all ``chunks`` of it, and
        the parent waits for it."""
        with self._locked() as fields:
            if fields[SERIAL] == serial:
                fields[MADE] += 1
            return bool(fields[MADE] == chunks and fields[SERIAL] == fields[WAITING] == serial)

    def fail(self, serial: int) -> bool:
        """Mark draw ``serial`` failed; whether the parent waits for it."""
        with self._locked() as fields:
            fields[FAILED] = serial
            return bool(fields[WAITING] == serial)

    def state(self, serial: int, chunks: int, *, wait: bool = False) -> str:
        """Draw ``serial``'s: "made", "failed" or "making" (and if ``wait``, the parent waits
        for it from now on, to be woken when it is made or failed)."""
        with self._locked() as fields:
            if fields[FAILED] == serial:
                return "failed"
            if fields[SERIAL] == serial and fields[MADE] == chunks:
                return "made"
            if wait:
                fields[WAITING] = serial
            return "making"

    def set(self, field: int, value: int) -> None:
        with self._locked() as fields:
            fields[field] = value

    def get(self, field: int) -> int:
        with self._locked() as fields:
            return int(fields[field])


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("dptune-noise", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


class NoiseProcess:
    """The parent's end: starts the child, shares buffers with it, asks it for draws."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))},
            )
        # sends are one at a time; re-entrant, since a buffer's finalizer, which sends too, may
        # run in a garbage collection started by a send in the same thread
        self._socket, self._lock = ours, threading.RLock()
        self.control = _Control(_memfd(8 * FIELDS))
        self._send(("control",), self.control.fd)
        self._ids, self._serials = itertools.count(), itertools.count(1)
        self._buffers: dict[int, tuple[int, int]] = {}  # address: buffer id, bytes
        self._closed = self._ready = False

    def _send(self, message: tuple[Any, ...], fd: int | None = None) -> None:
        try:
            with self._lock:
                socket.send_fds(self._socket, [pickle.dumps(message)], [] if fd is None else [fd])
        except OSError as error:
            raise self._gone() from error

    def shared_zeros(self, size: int, dtype: np.dtype[Any]) -> np.ndarray:
        """A zeroed array of ``size`` elements in memory this process shares with the child."""
        nbytes = size * dtype.itemsize
        fd = _memfd(nbytes)
        try:
            array = np.frombuffer(mmap.mmap(fd, nbytes), dtype=dtype)
            buffer = next(self._ids)
            self._send(("buffer", buffer, nbytes), fd)
        finally:
            os.close(fd)
        address = array.ctypes.data
        self._buffers[address] = (buffer, nbytes)
        weakref.finalize(array, self._free, address, buffer)
        return array

    def _free(self, address: int, buffer: int) -> None:
        self._buffers.pop(address, None)
        if self.alive():
            self._send(("free", buffer))

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return not self._closed and self._process.poll() is None

    def ready(self) -> bool:
        """Whether the child has started (until then, draws are made elsewhere); once it has,
        the block is not read again."""
        self._ready = self._ready or self.control.get(READY) == 1
        return self._ready and self.alive()

    def shares(self, flat: np.ndarray) -> bool:
        """Whether ``flat`` is a whole buffer of :meth:`shared_zeros`."""
        shared = self._buffers.get(flat.ctypes.data)
        return shared is not None and shared[1] == flat.nbytes

    def draw(self, keystream: Keystream, flat: np.ndarray, scale: float = 1.0) -> Draw:
        """Start the child drawing normals of standard deviation ``scale`` from ``keystream``
        into the shared ``flat`` (not empty: :func:`workers.dp.randomness.noise_buffer` shares
        none)."""
        buffer, _ = self._buffers[flat.ctypes.data]
        chunks, serial = claim(keystream, flat), next(self._serials)
        at = chunks[0][2]
        self._send(("draw", serial, buffer, flat.dtype.str, keystream.key, at, scale))
        return Draw(self, serial, keystream, flat, chunks, scale)

    def wait(self, serial: int, chunks: int, timeout: float | None) -> None:
        """Wait until draw ``serial``'s ``chunks`` are all made: the child wakes this process
        when it makes the last or fails the draw, since the block says that it waits."""
        while (state := self.control.state(serial, chunks, wait=True)) != "made":
            if state == "failed":
                raise NoiseProcessError("the noise process failed a draw (its error is in the log)")
            # (a wake-up left over from a wait that timed out only makes the loop look again)
            self._socket.settimeout(timeout)
            try:
                if not self._socket.recv(MESSAGE):
                    raise self._gone()
            except TimeoutError:
                raise TimeoutError(f"the noise process made no draw in {timeout} s") from None
            except OSError as error:
                raise self._gone() from error

    def _gone(self) -> NoiseProcessError:
        self._closed = True
        self._socket.close()
        return NoiseProcessError(f"the noise process exited (code {self._process.wait()})")


class Draw:
    """A draw being made by the noise process, chunk after chunk from the front."""

    def __init__(
        self,
        process: NoiseProcess,
        serial: int,
        keystream: Keystream,
        flat: np.ndarray,
        chunks: list[Chunk],
        scale: float,
    ) -> None:
        self._process, self._serial = process, serial
        self._keystream, self._flat, self._chunks = keystream, flat, chunks
        self._scale, self._finished = scale, False

    def done(self) -> bool:
        return (
            self._finished
            or self._process.control.state(self._serial, len(self._chunks)) != "making"
        )

    def finish(self, timeout: float | None = None) -> None:
        """Make the chunks nobody has taken, from the back, then wait for the child's."""
        if self._finished:
            return
        control, serial, count = self._process.control, self._serial, len(self._chunks)
        control.join(serial, count)
        while (index := control.take(serial, front=False)) is not None:
            make(self._keystream, self._flat, self._chunks[index], scale=self._scale)
            control.made(serial, count)
        self._process.wait(serial, count, timeout)
        self._finished = True


def noise_process() -> NoiseProcess:
    """This process's noise process, started on first use (again if it died; a forked child
    makes its own: the parent's socket is not its to use)."""
    global _current
    running = current()
    if running is None:
        running = NoiseProcess()
        _current = (os.getpid(), running)
    return running


def current() -> NoiseProcess | None:
    """This process's noise process if it has one running."""
    if _current is None or _current[0] != os.getpid() or not _current[1].alive():
        return None
    return _current[1]


# ------------------------------------------------------------------------------- the child
def serve(fd: int) -> None:
    """The child: make the draws asked for on the socket ``fd`` until it closes."""
    channel, buffers = socket.socket(fileno=fd), dict[int, mmap.mmap]()
    control: _Control | None = None
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, MESSAGE, 1)
        except ConnectionResetError:
            return
        if not data:  # the parent is gone
            return
        message = pickle.loads(data)
        if message[0] == "control":
            control = _Control(fds[0])  # its file stays open: its lock is taken on it
            control.set(READY, 1)
        elif message[0] == "buffer":
            try:
                buffers[message[1]] = mmap.mmap(fds[0], message[2])
            finally:
                os.close(fds[0])
        elif message[0] == "free":
            buffers.pop(message[1], None)  # a draw still making chunks holds its own reference
        elif message[0] == "draw" and control is not None:
            _draw(channel, control, buffers, *message[1:])


def _draw(
    channel: socket.socket,
    control: _Control,
    buffers: dict[int, mmap.mmap],
    serial: int,
    buffer: int,
    dtype: str,
    key: bytes,
    at: int,
    scale: float,
) -> None:
    """Make draw ``serial``'s chunks from the front until none is left; wake the parent if it
    waits and this made the last, or failed."""
    try:
        flat = np.frombuffer(buffers[buffer], dtype=dtype)
        chunks, keystream = plan(len(flat), flat.itemsize, at), Keystream(key)
        control.join(serial, len(chunks))
        while (index := control.take(serial, front=True)) is not None:
            make(keystream, flat, chunks[index], PIECE, scale)
            if control.made(serial, len(chunks)):
                channel.send(b"!")
    except Exception:  # the parent raises where it needs the noise; the log has the error
        traceback.print_exc()
        if control.fail(serial):
            channel.send(b"!")
