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

Gaussian draws use the Box–Muller transform in numpy on keystream words (numpy's ziggurat on
``randomgen``'s stream costs over twice as much: one call through the bit generator per draw).
numpy's logarithm, sine and cosine are its own SIMD kernels (AVX-512 or AVX2 where the CPU has
them): on the reference machine the transform in numpy takes about 0.6× the time of the same
one in torch's kernels (``bench/noise_cost.py``), and its loops release the GIL as torch's do.
The radius √(−2 ln v) takes a 53-bit v in (0, 1] (:func:`radii`), so the draws reach 8.57σ: a
32-bit uniform would cut the tails at 6.66σ, and a truncated Gaussian differs from the one the
accountant assumes by P(|Z| > 6.66) ≈ 2.7·10⁻¹¹ per draw — over 10⁹ draws (a million
parameters, a thousand steps) more than a typical δ; at 8.57σ it is about 10⁻¹⁷ per draw. The
angle takes as many bits as the output's significand holds, 24 for float32 noise
(:func:`angles`): 12 bytes of keystream a pair, where two 53-bit uniforms took 16.

On CUDA, copying host-generated noise for a large model every step would dominate the step, so
Gaussian draws are made on the device by torch's Philox generator, re-keyed for every draw from
the AES stream with a 63-bit key and a 61-bit counter offset (124 bits per draw that an
attacker would have to search, each draw independent of the others).

On CPU the engine may draw a step's noise ahead (:meth:`SecureStream.normal_ahead`, on a core
that torch's threads leave free, :func:`spare_core`): see ``workers.dp.engine.PrivateStep``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from core.entropy import Keystream, secure_generator

#: Gaussian pairs drawn per chunk (768 KiB of keystream for float32 noise)
CHUNK = 1 << 16
#: the bytes of keystream an angle takes, by the noise's dtype (:func:`angles`)
ANGLE_BYTES = {torch.float32: 4, torch.float64: 8}
#: the process that owns it, and the thread that draws noise ahead in that process
_noise_thread: tuple[int, ThreadPoolExecutor] | None = None


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
    ) -> Tensor:
        """Standard normal draws of ``shape`` on ``device``; written into ``out`` (a contiguous
        tensor of ``shape``, whose device and dtype then apply) if given, so that a caller's
        buffer takes the noise without a temporary of its size."""
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        if out is None:
            out = torch.empty(size, device=device, dtype=dtype)
        elif out.shape != size or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor of shape {size}")
        if out.device.type == "cuda":
            return out.normal_(generator=self._device_generator(out.device))
        if out.device.type == "cpu":
            self._box_muller(out.view(-1))
        else:
            out.copy_(self._box_muller(torch.empty(size, dtype=out.dtype).view(-1)).view(size))
        return out

    def _box_muller(self, out: Tensor) -> Tensor:
        """Fill the flat CPU tensor ``out`` with standard normals (:class:`_BoxMuller`)."""
        if out.dtype not in ANGLE_BYTES:  # half precision: drawn in float32, then rounded
            return out.copy_(self._box_muller(torch.empty(len(out))))
        _BoxMuller(self.keystream, out).run()
        return out

    def normal_ahead(self, out: Tensor) -> Drawing:
        """Start drawing standard normals into the contiguous tensor ``out`` on the process's
        one noise thread (its trials run one at a time): :meth:`normal`'s draw, to the bit. A
        subclass that changes :meth:`normal` (the audit's scaled noise) draws through it, and
        whoever waits for that draw only waits."""
        plain = type(self).normal is SecureStream.normal and out.is_contiguous()
        if not plain or out.device.type != "cpu" or out.dtype not in ANGLE_BYTES:
            return Drawing(out, None, _drawing_thread().submit(self.normal, out.shape, out=out))
        draw = _BoxMuller(self.keystream, out)
        return Drawing(out, draw, _drawing_thread().submit(draw.run))

    def integers(self, high: int) -> int:
        """A uniform integer in [0, high)."""
        return int(self.numpy.integers(high))

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """A Philox generator on ``device`` keyed (seed and counter offset) from this stream."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.integers(2**63))
        generator.set_offset(4 * self.integers(2**61))  # Philox offsets advance in fours
        return generator


class _BoxMuller:
    """One draw of standard normals into the flat float32 or float64 CPU tensor ``out``, in
    chunks of at most ``CHUNK`` pairs: r·cos θ for a chunk's first half, r·sin θ for its
    second. Each pair takes 8 bytes of keystream for its radius, then (after the chunk's radii)
    4 for its angle, 8 when ``out`` is float64 (:func:`radii`, :func:`angles`): the chunks'
    bytes are claimed in order when the draw is planned, so they are the bytes one thread
    reading the stream would have read, and any thread may make any chunk. :meth:`run` makes
    chunks until none is left, and two threads may run it at once: each chunk is taken once
    (``itertools.count``, whose ``next`` is atomic) and writes its own part of ``out``.

    Within a chunk the radii are formed in ``out`` itself, the sines too, and the cosines
    overwrite the angles, so a chunk holds at most its radii's words, then its angles' words
    and the angles."""

    def __init__(self, keystream: Keystream, out: Tensor) -> None:
        self.keystream, self.flat = keystream, out.detach().view(-1).numpy()
        self.angle_bytes = ANGLE_BYTES[out.dtype]
        self.chunks: list[tuple[int, int, int]] = []  # start, stop in ``out``; keystream byte
        for start in range(0, len(self.flat), 2 * CHUNK):
            stop = min(start + 2 * CHUNK, len(self.flat))
            half = (stop - start + 1) // 2  # pairs: an odd tail drops its last sine
            self.chunks.append((start, stop, keystream.claim((8 + self.angle_bytes) * half)))
        self._taken = itertools.count()

    def run(self) -> None:
        while (index := next(self._taken)) < len(self.chunks):
            self._chunk(*self.chunks[index])

    def _chunk(self, start: int, stop: int, at: int) -> None:
        part = self.flat[start:stop]
        half = (len(part) + 1) // 2
        radius, sine = part[:half], part[half:]
        radii(self.keystream.read(at, 8 * half).view(np.int64), out=radius)
        words = self.keystream.read(at + 8 * half, self.angle_bytes * half)
        angle = angles(words.view(f"i{self.angle_bytes}"))
        np.multiply(np.sin(angle[: len(sine)], out=sine), radius[: len(sine)], out=sine)
        np.multiply(radius, np.cos(angle, out=angle), out=radius)


class Drawing:
    """Standard normals being drawn into ``out`` on the noise thread. :meth:`result` waits for
    them, and meanwhile makes the draw's chunks that the thread has not begun: whoever asks for
    noise that is not ready has nothing else to do, and on a spare core the two halve what is
    left (``workers.dp.engine``: logreg's step at B = 64 waited for its draw)."""

    def __init__(self, out: Tensor, draw: _BoxMuller | None, future: Future[Any]) -> None:
        self.out, self._draw, self._future = out, draw, future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Tensor:
        """``out`` once drawn (the thread's error, if its part failed)."""
        if self._draw is not None and not self._future.done():
            self._draw.run()
        self._future.result(timeout)
        return self.out


def radii(words: np.ndarray, *, out: np.ndarray) -> np.ndarray:
    """Box–Muller radii r = √(−2 ln v) from 64-bit keystream words (overwritten), into ``out``
    (float32 or float64).

    v = m·2⁻⁵³ with m = (w >> 11) + 2⁵² + 1, uniform on 1, …, 2⁵³: 53 bits, v in (0, 1]
    exactly, so the tail reaches √(−2 ln 2⁻⁵³) ≈ 8.57σ (a 32-bit v would cut it at 6.66σ: see
    the module docstring). v is rounded to ``out``'s dtype once, as m converts (float32: by at
    most 2⁻²⁴ relative, moving r by about 10⁻⁷ relative; the smallest v, 2⁻⁵³, is exact; the
    scaling by a power of two is exact), and its logarithm taken in that dtype, half float64's
    cost in float32."""
    m = np.right_shift(words, 11, out=words)
    m += 2**52 + 1
    np.copyto(out, m, casting="unsafe")
    out *= 2.0**-53
    np.log(out, out=out)
    out *= -2.0
    return np.sqrt(out, out=out)


def angles(words: np.ndarray) -> np.ndarray:
    """Box–Muller angles θ = 2π·k·2⁻ᵇ in [−π, π) from keystream words (overwritten), k their
    top b bits as a signed integer, uniform on −2ᵇ⁻¹, …, 2ᵇ⁻¹ − 1: in float32 with b = 24 from
    32-bit words (a float32 significand, so k is exact in float32), in float64 with b = 53
    from 64-bit ones."""
    bits, dtype = (24, np.float32) if words.itemsize == 4 else (53, np.float64)
    k = np.right_shift(words, 8 * words.itemsize - bits, out=words)
    angle = k.astype(dtype)
    angle *= 2 * math.pi * 2.0**-bits
    return angle


def _drawing_thread() -> ThreadPoolExecutor:
    """This process's one noise thread (its trials run one at a time), made on first use. A
    forked child inherits the parent's executor but not its thread, and work queued there
    would never run, so a child makes its own."""
    global _noise_thread
    if _noise_thread is None or _noise_thread[0] != os.getpid():
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dptune-noise")
        _noise_thread = (os.getpid(), pool)
    return _noise_thread[1]


def spare_core() -> bool:
    """Whether this process may run on more cores than torch's threads use (a trial sets them
    to its CPU request): only then does drawing noise ahead (:meth:`SecureStream.normal_ahead`)
    run beside the step rather than take turns with it."""
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

    def init_seed(self) -> int:
        """A 63-bit seed for torch's initialisers. Initial weights are not what DP protects
        (the guarantee holds for any public initialisation), but an attacker who knew them
        would need fewer assumptions, so they are not reproducible either."""
        return self.init.integers(2**63)
