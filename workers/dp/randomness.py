"""Randomness that protects privacy (docs/design.md, invariant 8).

Every draw a DP guarantee rests on — Poisson sampling, gradient noise, the noisy statistics of
adaptive clipping rules, validation noise, the private hold-out, the candidates of a
random-stopping job — comes from a :class:`SecureStream`: AES-128 in counter mode (the core of
NIST SP 800-90A's CTR_DRBG; ``randomgen.AESCounter``, AES-NI where the CPU has it) keyed with
128 bits from the operating system's entropy pool (:func:`core.entropy.secure_generator`, which
the driver uses directly), one fresh key per stream, so streams are
independent and nothing stored, chosen or seen by an analyst can reproduce them. There is no
seeded mode.

Why not ``torch.Generator``: its CPU generator (mt19937) keeps only the low 32 bits of a
seed, so one released noisy number lets an attacker search all 2³² seeds, recover the noise
and subtract it. AES-CTR output reveals nothing about its key.

Gaussian draws use the Box–Muller transform in torch on 53-bit uniforms (numpy's ziggurat on
top of the same stream costs three times as much). In the radius √(−2 ln(1 − u)), 1 − u is
formed exactly from a 53-bit u (its logarithm is then taken in float32, see ``_box_muller``),
so the draws reach 8.57σ: a 32-bit uniform would cut the tails at 6.66σ, and a
truncated Gaussian differs from the one the accountant assumes by P(|Z| > 6.66) ≈ 2.7·10⁻¹¹ per
draw — over 10⁹ draws (a million parameters, a thousand steps) more than a typical δ; at 8.57σ
it is about 10⁻¹⁷ per draw.

On CUDA, copying host-generated noise for a large model every step would dominate the step, so
Gaussian draws are made on the device by torch's Philox generator, re-keyed for every draw from
the AES stream with a 63-bit key and a 61-bit counter offset (124 bits per draw that an
attacker would have to search, each draw independent of the others).

On CPU the engine may draw a step's noise ahead (:meth:`SecureStream.normal_ahead`, on a core
that torch's threads leave free, :func:`spare_core`): see ``workers.dp.engine.PrivateStep``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from core.entropy import secure_generator

#: Gaussian pairs drawn per chunk (two draws of 512 KiB of float64 uniforms)
CHUNK = 1 << 16
#: the process that owns it, and the thread that draws noise ahead in that process
_noise_thread: tuple[int, ThreadPoolExecutor] | None = None


class SecureStream:
    """An independent stream of cryptographically secure random numbers."""

    def __init__(self) -> None:
        self.numpy = secure_generator()

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
        """Fill the flat CPU tensor ``out`` with standard normals: pairs r·cos θ, r·sin θ with
        r = √(−2 ln v), v = 1 − u₁ from a 53-bit u₁ (see the module docstring), and θ = 2πu₂,
        in chunks of at most ``CHUNK`` pairs so the float64 transients stay small: the radii's
        uniforms, then the angles' (the order the stream has always given them in), each freed
        once converted, with 1 − u₁ formed in place.

        v is exact in float64 and, cast to float32 (or ``out``'s dtype if wider), keeps its
        full range: the smallest v = 2⁻⁵³ is a power of two, so the tail still reaches 8.57σ,
        and elsewhere v is rounded by at most 2⁻²⁴ relative, moving r by about 10⁻⁷ relative.
        The logarithm is then taken in float32, half the cost of float64's."""
        work = torch.promote_types(out.dtype, torch.float32)
        for start in range(0, len(out), 2 * CHUNK):
            part = out[start : start + 2 * CHUNK]
            half = (len(part) + 1) // 2  # pairs: an odd tail drops its last sine
            v = self.uniform(half).neg_().add_(1.0)  # exact: u₁ is a multiple of 2⁻⁵³ below 1
            radius = v.to(work).log_().mul_(-2.0).sqrt_()
            del v
            angle = self.uniform(half).to(work).mul_(2 * math.pi)
            torch.mul(radius, torch.cos(angle), out=part[:half])
            part[half:] = radius.mul_(angle.sin_())[: len(part) - half]
        return out

    def normal_ahead(self, out: Tensor) -> Future[Tensor]:
        """Start drawing standard normals into ``out`` on the process's one noise thread (its
        trials run one at a time); the future holds ``out`` when done, or the draw's error."""
        return _drawing_thread().submit(self.normal, out.shape, out=out)

    def integers(self, high: int) -> int:
        """A uniform integer in [0, high)."""
        return int(self.numpy.integers(high))

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """A Philox generator on ``device`` keyed (seed and counter offset) from this stream."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.integers(2**63))
        generator.set_offset(4 * self.integers(2**61))  # Philox offsets advance in fours
        return generator


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
