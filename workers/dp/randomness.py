"""Randomness that protects privacy (docs/design.md, invariant 8).

Every draw a DP guarantee rests on — Poisson sampling, gradient noise, the noisy statistics of
adaptive clipping rules, validation noise, the private hold-out, the candidates of a
random-stopping job — comes from a :class:`SecureStream`: AES-128 in counter mode (the core of
NIST SP 800-90A's CTR_DRBG, AES-NI where the CPU has it) keyed with 128 bits from the operating
system's entropy pool, one fresh key per stream, so streams are independent and nothing
stored, chosen or seen by an analyst can reproduce them. There is no seeded mode. A stream
holds two such generators under independent keys (:mod:`core.entropy`): its Gaussian draws
come from OpenSSL's AES-CTR keystream (:class:`core.entropy.Keystream`), the rest from a numpy
``Generator`` over ``randomgen.AESCounter`` (:func:`core.entropy.secure_generator`, which the
driver uses directly).

Why not ``torch.Generator``: its CPU generator (mt19937) keeps only the low 32 bits of a
seed, so one released noisy number lets an attacker search all 2³² seeds, recover the noise
and subtract it. AES-CTR output reveals nothing about its key.

Gaussian draws use the Box–Muller transform in numpy on keystream words (not numpy's ziggurat
on ``randomgen``'s stream, which calls through the bit generator once per draw). numpy's
logarithm, sine and cosine are its own SIMD kernels (AVX-512 or AVX2 where the CPU has them),
faster on CPU than torch's kernels for the same functions (docs/performance.md, "What the
secure noise costs"), and their loops release the GIL as torch's do (the transform:
``workers.gaussian``). The radius √(−2 ln v) takes a 53-bit v in (0, 1], so
the draws reach 8.57σ: a 32-bit uniform would cut the tails at 6.66σ, and a truncated
Gaussian differs from the one the accountant assumes by P(|Z| > 6.66) ≈ 2.7·10⁻¹¹ per draw —
over 10⁹ draws (a million parameters, a thousand steps) more than a typical δ; at 8.57σ it is
about 10⁻¹⁷ per draw. The angle takes as many bits as the output's significand holds, 24 for
float32 noise: 12 bytes of keystream a pair, not the 16 of two 53-bit uniforms.

On CUDA, copying host-generated noise for a large model every step would dominate the step, so
Gaussian draws are made on the device (:mod:`workers.dp.normal`): the same Box–Muller transform
of 64-bit words, the words drawn by torch's Philox generator, re-keyed for every draw from the
AES stream with a 64-bit key and a 61-bit counter offset (125 bits per draw that an attacker
would have to search, each draw independent of the others). Not torch's ``normal_``: curand's
Box–Muller takes 32-bit uniforms and truncates the tails (invariant 15). Other accelerators
draw on the host and copy.

On CPU the engine may draw a step's noise ahead, on a core that torch's threads leave free
(:func:`spare_core`): a :class:`NoiseChild` draws it in a process of its own, under a key of
its own, into the gradient buffer the two share (``workers.dp.engine.PrivateStep``). A
process, not a thread: a draw is a few dozen numpy and OpenSSL calls, each taking Python's GIL
back from a step made of hundreds of small torch calls, each hand-over a wake-up on the other
core, so a draw on a thread slows a small model's step where one in a process of its own does
not hold the step's GIL at all.
"""

from __future__ import annotations

import mmap
import os
import select
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from core.entropy import Keystream, secure_generator
from workers.dp.normal import ANGLE_BYTES, normal_
from workers.gaussian import MADE, READY, draw

#: torch's CPU generator state (``CPUGeneratorImplState`` in ATen's ``CPUGeneratorImpl.cpp``,
#: 5,056 bytes): its mt19937's seed, ``left``, ``seeded``, ``next`` and the 624 32-bit words of
#: its state, each in a 64-bit slot; the rest (cached normal samples, flagged invalid) zeros
_CPU_STATE = np.dtype(
    {
        "names": ["seed", "left", "seeded", "next", "state"],
        "formats": ["<u8", "<i4", "<i4", "<u8", ("<u8", 624)],
        "offsets": [0, 8, 12, 16, 24],
        "itemsize": 5056,
    }
)
#: the child's program (``workers.gaussian.serve``): its arguments are the shared file's
#: descriptor, the buffer's size and its numpy dtype
_SERVE = (
    "import sys; from workers.gaussian import serve; serve(*map(int, sys.argv[1:3]), sys.argv[3])"
)


class SecureStream:
    """An independent stream of cryptographically secure random numbers."""

    def __init__(self) -> None:
        self.numpy = secure_generator()
        self.keystream = Keystream()  # Gaussian draws (:meth:`normal`)

    def uniform(self, n: int) -> Tensor:
        """``n`` uniforms on [0, 1) in float64 (multiples of 2⁻⁵³)."""
        return torch.from_numpy(self.numpy.random(n))

    def bernoulli(self, n: int, p: float) -> Tensor:
        """``n`` independent Bernoulli(p) indicators. The comparison is in float64: float32
        uniforms are multiples of 2⁻²⁴ and a float32 ``p`` rounds, so ``u < p`` would hold
        with a probability above ``p`` — more than the accountant's sampling rate."""
        return self.uniform(n) < p

    def normal(
        self,
        shape: int | Sequence[int],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        out: Tensor | None = None,
        scale: float = 1.0,
    ) -> Tensor:
        """Normal draws of ``shape`` on ``device``, mean 0 and standard deviation ``scale``;
        written into ``out`` (a contiguous tensor of ``shape``, whose device and dtype then
        apply) if given, so that a caller's buffer takes the noise without a temporary of its
        size, and scaled as they are made, without a pass of their own over it."""
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        if out is None:
            out = torch.empty(size, device=device, dtype=dtype)
        elif out.shape != size or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor of shape {size}")
        if out.device.type == "cuda":
            return normal_(out, self._device_generator(out.device), scale)
        if out.device.type == "cpu":
            self._box_muller(out.view(-1), scale)
        else:
            flat = torch.empty(size, dtype=out.dtype).view(-1)
            out.copy_(self._box_muller(flat, scale).view(size))
        return out

    def _box_muller(self, out: Tensor, scale: float) -> Tensor:
        """Fill the flat CPU tensor ``out`` with normals of standard deviation ``scale``
        (``workers.gaussian``)."""
        if out.dtype not in ANGLE_BYTES:  # half precision: drawn in float32, then rounded
            return out.copy_(self._box_muller(torch.empty(len(out)), scale))
        draw(self.keystream, out.detach().numpy(), scale)
        return out

    def child(self, size: int, dtype: torch.dtype) -> NoiseChild | None:
        """A :class:`NoiseChild` that draws this kind of noise ahead into a CPU buffer of
        ``size`` values of ``dtype``; None where it cannot: half precision, an empty buffer,
        and a subclass that changes :meth:`normal` (the audit's scaled noise), whose draws
        must go through it."""
        if type(self).normal is not SecureStream.normal or size == 0 or dtype not in ANGLE_BYTES:
            return None
        return NoiseChild(size, dtype)

    def integers(self, high: int) -> int:
        """A uniform integer in [0, high)."""
        return int(self.numpy.integers(high))

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """A Philox generator on ``device`` keyed from this stream (:meth:`key_philox`)."""
        return self.key_philox(torch.Generator(device=device))

    def key_philox(self, generator: torch.Generator) -> torch.Generator:
        """Key the CUDA ``generator`` from this stream: Philox's whole 64-bit seed and a
        counter offset (offsets advance in fours)."""
        generator.manual_seed(int(self.numpy.bit_generator.random_raw()))
        generator.set_offset(4 * self.integers(2**61))
        return generator


class NoiseChildError(RuntimeError):
    """The noise child failed a draw (its error is in the log), or is gone."""


class NoiseChild:
    """A process that draws a trial's Gaussian noise into the zeroed CPU buffer :attr:`flat`,
    which the two share, one draw per :meth:`request`. It makes its own keystream, under a key
    freshly drawn from its own OS entropy that never leaves it (``workers.gaussian.serve``):
    this process never reads those bytes, nor the child this process's. Started with the
    buffer, it imports numpy and ``cryptography``, not torch (:meth:`ready` says
    when), and exits when the buffer's owner is gone (its stdin closes).

    Not a ``multiprocessing`` child: spawning one runs the parent's ``__main__`` again (a Ray
    worker's, which imports Ray), and forking a threaded torch process is unsafe."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        numpy_dtype = np.dtype(np.float32 if dtype == torch.float32 else np.float64)
        nbytes, shared = size * numpy_dtype.itemsize, _shared_zeros(size * numpy_dtype.itemsize)
        try:
            memory = mmap.mmap(shared, nbytes)
            path = os.pathsep.join(filter(None, sys.path))
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(shared), str(size), numpy_dtype.str],
                pass_fds=[shared],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env={**os.environ, "PYTHONPATH": path},
            )
        finally:
            os.close(shared)
        self.flat = torch.from_numpy(np.frombuffer(memory, dtype=numpy_dtype))
        self._started = self._asked = False
        weakref.finalize(self, _close, self._process)

    @property
    def pid(self) -> int:
        return self._process.pid

    def ready(self) -> bool:
        """Whether the child has started (it reads requests only then); never blocks."""
        if not self._started:
            replies = self._process.stdout
            assert replies is not None
            readable, _, _ = select.select([replies], [], [], 0)
            self._started = bool(readable) and self._reply() == READY
        return self._started

    def request(self, scale: float) -> None:
        """Have the child draw the next normals of standard deviation ``scale`` into
        :attr:`flat` (which nothing may touch until :meth:`wait` returns)."""
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(f"{scale!r}\n".encode())
        except OSError as error:
            raise self._gone() from error
        self._asked = True

    def wait(self) -> None:
        """Wait until the draw requested last is in :attr:`flat` (at once if it was waited
        for already)."""
        if not self._asked:
            return
        self._asked = False
        if self._reply() != MADE:
            raise NoiseChildError("the noise child failed a draw (its error is in the log)")

    def _reply(self) -> bytes:
        assert self._process.stdout is not None
        reply = os.read(self._process.stdout.fileno(), 1)
        if not reply:
            raise self._gone()
        return reply

    def _gone(self) -> NoiseChildError:
        return NoiseChildError(f"the noise child exited (code {self._process.wait()})")


def _shared_zeros(nbytes: int) -> int:
    """A descriptor of ``nbytes`` zeros that a child can map: anonymous memory on Linux
    (``memfd_create``, which no tmpfs's size limits), elsewhere (macOS) an unlinked temporary
    file."""
    if hasattr(os, "memfd_create"):
        shared = os.memfd_create("dptune-noise")
    else:
        shared, path = tempfile.mkstemp()
        os.unlink(path)
    os.ftruncate(shared, nbytes)
    return shared


def _close(process: subprocess.Popen[bytes]) -> None:
    """Close the child's pipes: it reads the end of its requests and exits."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def spare_core() -> bool:
    """Whether this process may run on more cores than torch's threads use (a trial sets them
    to its CPU request): only then does a :class:`NoiseChild` draw beside the step rather
    than take turns with it."""
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return cores > torch.get_num_threads()


class TrialRandomness:
    """The independent streams of one trial attempt, each freshly keyed on creation."""

    def __init__(self) -> None:
        self.sampling = SecureStream()  # Poisson sampling of logical batches
        self.gradient = SecureStream()  # the Gaussian noise of every private gradient
        self.release = SecureStream()  # noisy statistics of adaptive clipping rules
        self.validation = SecureStream()  # the noisy selection score
        self.holdout = SecureStream()  # which examples form the private validation split
        self.init = SecureStream()  # model initialisation (not a DP guarantee, kept secret)

    def seed_torch(self, device: torch.device) -> None:
        """Key torch's generators for the model's initialisers from the ``init`` stream, with
        full entropy: the CPU generator's whole mt19937 state, and on CUDA ``device``'s Philox
        generator (:meth:`SecureStream.key_philox`). Initial weights are not what DP protects
        (the guarantee holds for any public initialisation), but an attacker who knew them
        would need fewer assumptions, so they are not reproducible either — and a seed would
        be: ``torch.manual_seed`` keeps only a seed's low 32 bits on CPU."""
        torch.set_rng_state(mt19937_state(self.init.keystream.next(4 * 624).view(np.uint32)))
        if device.type == "cuda":
            torch.cuda.init()  # its default generators exist once CUDA is initialised
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.init.key_philox(torch.cuda.default_generators[index])


def mt19937_state(words: np.ndarray) -> Tensor:
    """torch's CPU generator state (for ``torch.set_rng_state``) whose mt19937 state is the 624
    32-bit ``words``, the first with its top bit set: mt19937's recurrence uses only that bit
    of the first word, and setting it keeps the state from being all zeros, as Matsumoto and
    Nishimura's ``init_by_array`` does. ``left`` = 1 regenerates the whole state before the
    first output, so every output depends on all 19,937 bits."""
    state = np.zeros(1, _CPU_STATE)
    state["state"][0] = words
    state["state"][0, 0] |= 0x8000_0000
    state["left"], state["seeded"], state["next"] = 1, 1, 0
    return torch.from_numpy(state.view(np.uint8))
