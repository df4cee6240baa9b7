"""Standard normals on any torch device: ``workers.gaussian``'s Box–Muller transform, in torch.

The engine's CPU noise is made in numpy from the AES keystream (``workers.gaussian``, which
says why 53-bit uniforms: the tails reach 8.57σ). On CUDA, copying host-made noise for a large
model every step would dominate the step, so the words are drawn on the device, by a Philox
generator that ``workers.dp.randomness`` keys from the AES stream, and transformed here, on
the device, as ``workers.gaussian`` transforms keystream words: the same words give the same
normals, to the rounding of the logarithm, sine and cosine kernels. Not torch's own
``normal_``: on CUDA it is curand's Box–Muller on 32-bit uniforms, whose tails stop near 6.7σ —
a truncated Gaussian, which the accountant does not price (invariant 15).

No float64 is needed on the device: v rounds to float32 by at most 2⁻²⁴ relative, and the
smallest v, 2⁻⁵³, is exact, so float32 radii reach 8.57σ too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from workers.gaussian import ANGLE_BITS, RADIUS_OFFSET, RADIUS_SHIFT, RADIUS_UNIT

#: Gaussian pairs made at once on a device: 48 MiB of words and 16 MiB of angles for float32
#: noise, whatever the model's size
DEVICE_PAIRS = 1 << 22
#: the width in bytes of an angle's words, by the noise's dtype (``workers.gaussian.angles``)
ANGLE_BYTES = {torch.float32: 4, torch.float64: 8}
#: a word's signed integer type, by its width in bytes
_WORDS = {4: torch.int32, 8: torch.int64}


def normal_(out: Tensor, generator: torch.Generator, scale: float = 1.0) -> Tensor:
    """Fill the contiguous ``out`` with normals of standard deviation ``scale``, from words
    that ``generator`` (on ``out``'s device) draws, ``DEVICE_PAIRS`` pairs at a time (each
    part as :func:`box_muller` lays it out). Half-precision noise is made in float32, then
    rounded, as on the CPU."""
    if out.dtype not in ANGLE_BYTES:
        return out.copy_(normal_(torch.empty_like(out, dtype=torch.float32), generator, scale))
    flat = out.view(-1)
    for start in range(0, len(flat), 2 * DEVICE_PAIRS):
        part = flat[start : start + 2 * DEVICE_PAIRS]
        pairs, width = (len(part) + 1) // 2, ANGLE_BYTES[out.dtype]
        drawn = words(pairs + -(-pairs * width // 8), generator)
        box_muller(drawn[:pairs], drawn[pairs:].view(_WORDS[width])[:pairs], part, scale)
    return out


def words(n: int, generator: torch.Generator) -> Tensor:
    """``n`` uniform 64-bit words (int64) drawn by ``generator`` on its device. ``random_``
    from −2⁶³ with no upper bound is torch's full-range draw: 64 random bits a value on CPU
    (two mt19937 outputs) and on CUDA (two 32-bit Philox outputs; ATen's
    ``random_full_64_bits_range_kernel``), with no reduction modulo a range."""
    drawn = torch.empty(n, dtype=torch.int64, device=generator.device)
    return drawn.random_(-(2**63), None, generator=generator)


def box_muller(
    radius_words: Tensor, angle_words: Tensor, out: Tensor, scale: float = 1.0
) -> Tensor:
    """Normals of standard deviation ``scale`` into the flat float32 or float64 ``out`` from
    one word of each kind a pair (both overwritten), laid out as a chunk of
    ``workers.gaussian.make``: r·cos θ in the first ⌈n/2⌉ places, r·sin θ in the rest (an odd
    ``out`` drops the last sine). The scale multiplies the radii, half the values."""
    half = (len(out) + 1) // 2
    radius, sine = out[:half], out[half:]
    radii(radius_words, out=radius)
    if scale != 1.0:
        radius.mul_(scale)
    angle = angles(angle_words)
    torch.sin(angle[: len(sine)], out=sine).mul_(radius[: len(sine)])
    radius.mul_(angle.cos_())
    return out


def radii(words: Tensor, *, out: Tensor) -> Tensor:
    """Box–Muller radii r = √(−2 ln v) from int64 words (overwritten) into ``out`` (float32 or
    float64): ``workers.gaussian.radii`` in torch, v = m·2⁻⁵³ with m uniform on 1, …, 2⁵³
    (an arithmetic shift, as numpy's), rounded to ``out``'s dtype once as m converts."""
    m = words.bitwise_right_shift_(RADIUS_SHIFT).add_(RADIUS_OFFSET)
    return out.copy_(m).mul_(RADIUS_UNIT).log_().mul_(-2.0).sqrt_()


def angles(words: Tensor) -> Tensor:
    """Box–Muller angles θ = 2π·k·2⁻ᵇ in [−π, π) from int32 or int64 words (overwritten):
    ``workers.gaussian.angles`` in torch, float32 with b = 24 from int32 words, float64 with
    b = 53 from int64 ones (k, their top b bits as a signed integer, is exact in either)."""
    width = words.element_size()
    bits = ANGLE_BITS[width]
    k = words.bitwise_right_shift_(8 * width - bits)
    dtype = torch.float32 if width == 4 else torch.float64
    return k.to(dtype).mul_(2 * math.pi * 2.0**-bits)
