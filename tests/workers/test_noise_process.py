"""The trial's noise process (``workers.noise_process``): a draw made there, or partly there and
partly here, is the draw this process would make alone, to the bit; each chunk is made once;
failures surface where the noise is needed; the child never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from core.entropy import Keystream
from workers import noise_process
from workers.dp.randomness import SecureStream, noise_buffer
from workers.gaussian import CHUNK, plan
from workers.noise_process import FRONT, MADE, NoiseProcessError


def keyed(key: bytes) -> SecureStream:
    stream = SecureStream()
    stream.keystream = Keystream(key)
    return stream


def started() -> noise_process.NoiseProcess:
    process = noise_process.noise_process()
    deadline = time.monotonic() + 30
    while not process.ready():
        assert time.monotonic() < deadline, "the noise process did not start"
        time.sleep(0.01)
    return process


class Counted:
    """Test double for ``workers.noise_process.make`` in this process: counts its chunks."""

    def __init__(self) -> None:
        self.chunks = 0
        self._make = noise_process.make

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.chunks += 1
        self._make(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("size", "scale"), [(1, 1.0), (7, 0.37), (2 * CHUNK, 1.0), (10 * CHUNK + 3, 2.5)]
)
def test_a_draw_made_in_the_noise_process_is_the_draw_made_here(
    dtype, size, scale, monkeypatch
) -> None:
    """Nobody waits for it: the child makes all of it (at the standard deviation asked for),
    and the stream goes on after it as after the same draw made here."""
    started()
    counted = Counted()
    monkeypatch.setattr(noise_process, "make", counted)
    key = os.urandom(16)
    there, here = keyed(key), keyed(key)
    out = noise_buffer(size, dtype)
    drawing = there.normal_ahead(out, scale)
    deadline = time.monotonic() + 10
    while not drawing.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert drawing.result() is out and counted.chunks == 0  # all made by the child
    assert torch.equal(out, here.normal(size, dtype=dtype, scale=scale))
    assert torch.equal(there.normal(99, dtype=dtype), here.normal(99, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_whoever_waits_makes_the_chunks_nobody_took_to_the_same_bits(dtype, monkeypatch) -> None:
    """Asked for as soon as the child has begun it, a long draw is made from both ends, each
    chunk once: the same draw as one process makes."""
    process = started()
    counted = Counted()
    monkeypatch.setattr(noise_process, "make", counted)
    key, size = os.urandom(16), 64 * 2 * CHUNK + 5  # 65 chunks
    there, here = keyed(key), keyed(key)
    out = noise_buffer(size, dtype)
    drawing = there.normal_ahead(out, 0.37)
    deadline = time.monotonic() + 10
    while process.control.get(FRONT) == 0 and time.monotonic() < deadline:
        time.sleep(0.0001)  # the child has taken its first chunk
    drawing.result()
    assert 0 < counted.chunks < 65  # both made some, at the standard deviation asked for
    assert torch.equal(out, here.normal(size, dtype=dtype, scale=0.37))


def test_a_draw_the_child_has_not_reached_is_made_here_and_never_again(monkeypatch) -> None:
    """A draw abandoned unfinished (a trial that stopped) holds the child up; the next one,
    needed at once, is begun here, which stops the child's work on the abandoned one (it
    then joins in the new one, or finds it made): the same bits, and the buffer is not
    written after the draw was handed over."""
    started()
    key = os.urandom(16)
    there, here = keyed(key), keyed(key)
    abandoned = noise_buffer(64 * 2 * CHUNK, torch.float32)
    there.normal_ahead(abandoned)
    here.normal(len(abandoned))  # the same bytes of the stream, skipped
    counted = Counted()
    monkeypatch.setattr(noise_process, "make", counted)
    out = noise_buffer(3 * 2 * CHUNK, torch.float32)
    there.normal_ahead(out).result()
    assert counted.chunks >= 1  # begun here: the child was on the abandoned draw
    expected = here.normal(len(out))
    assert torch.equal(out, expected)
    time.sleep(0.5)  # the child has stopped the abandoned draw and seen this one
    assert torch.equal(out, expected)


def test_a_failed_draw_raises_where_its_noise_is_needed() -> None:
    """The child cannot make a draw into a buffer it was never given: the error is raised by
    the result, not lost."""
    process = started()
    stream = keyed(os.urandom(16))
    flat = np.zeros(10, dtype=np.float32)  # not shared: the child has no buffer 10**6
    at = stream.keystream.claim(0)
    serial = next(process._serials)
    process._send(("draw", serial, 10**6, flat.dtype.str, stream.keystream.key, at, 1.0))
    chunks = plan(len(flat), flat.itemsize, at)
    draw = noise_process.Draw(process, serial, stream.keystream, flat, chunks, 1.0)
    deadline = time.monotonic() + 10
    while not draw.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(NoiseProcessError, match="failed a draw"):
        draw.finish()


def test_a_noise_process_dead_in_a_chunk_fails_the_draw_and_a_new_one_starts() -> None:
    process = started()
    out = noise_buffer(64 * 2 * CHUNK, torch.float32)
    while True:  # stop the child inside a chunk it has taken, then kill it there
        drawing = keyed(os.urandom(16)).normal_ahead(out)
        while process.control.get(FRONT) == 0 and not drawing.done():
            time.sleep(0.0001)
        os.kill(process.pid, signal.SIGSTOP)
        if process.control.get(MADE) < process.control.get(FRONT):
            break
        os.kill(process.pid, signal.SIGCONT)  # between chunks, or done: again
        drawing.result()
    os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(NoiseProcessError, match="exited"):
        drawing.result(timeout=10)
    assert noise_process.current() is None
    assert started() is not process


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited; its reaper may be slow in a container)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False


def test_the_child_exits_with_its_parent_and_imports_no_torch() -> None:
    script = (
        "import sys, time; from workers import noise_process as n; p = n.noise_process()\n"
        "while not p.ready(): time.sleep(0.01)\n"
        "print(p.pid, flush=True)"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    deadline = time.monotonic() + 10
    while running(int(parent.stdout)):
        assert time.monotonic() < deadline, "the noise process outlived its parent"
        time.sleep(0.05)
    check = "import sys, workers.noise_process; print('torch' in sys.modules)"
    imported = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60
    )
    assert imported.stdout.strip() == "False"


def test_draws_nobody_waits_for_never_fill_the_socket() -> None:
    """A trial whose draws are always made before they are needed waits for none: the child
    must not write a wake-up for each: the parent would read none of them, after 278 of them
    the socket's buffer is full, the child blocks on it and stops reading requests, and the
    parent blocks on its next request (the trials of the first version of this stopped so)."""
    started()
    stream, out = keyed(os.urandom(16)), noise_buffer(1000, torch.float32)

    def draws() -> None:
        for _ in range(400):
            drawing = stream.normal_ahead(out)
            while not drawing.done():
                time.sleep(0.001)
            drawing.result()

    worker = threading.Thread(target=draws, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the draws stopped: the socket filled up"
