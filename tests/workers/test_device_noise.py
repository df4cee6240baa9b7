"""Full-tailed noise on every device (docs/design.md, invariant 15).

The attack this stops: CUDA noise came from torch's ``normal_`` (curand's Box–Muller on 32-bit
uniforms), which never exceeded 6.764σ in 2.1·10¹² draws on an H200 where a Gaussian gives
28.6: a truncated Gaussian, not the one the accountant prices. The device path is now
``workers.dp.normal``, the CPU path's transform of 64-bit words in torch; the CPU suite runs it
on CPU tensors, and the CUDA tests below run wherever a GPU is.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from core.entropy import Keystream
from workers import gaussian
from workers.dp import normal
from workers.dp.randomness import SecureStream, TrialRandomness

#: the largest radius 53-bit uniforms give: √(−2 ln 2⁻⁵³)
TAIL = math.sqrt(2 * 53 * math.log(2))
#: radius words whose v is the smallest, 2⁻⁵³ (w >> 11 = −2⁵²)
SMALLEST_V = [-(2**63), -(2**63) + 2**11 - 1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cpu_draw(key: bytes, n: int, dtype: torch.dtype, scale: float) -> np.ndarray:
    """The CPU product's draw of ``n`` normals from the keystream under ``key``."""
    stream = SecureStream()
    stream.keystream = Keystream(key)
    return stream.normal(n, dtype=dtype, scale=scale).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "scale"), [(1, 1.0), (2, 0.37), (4097, 1.0), (10_000, 3e-3)])
def test_the_device_transform_makes_the_cpu_draw_from_the_same_words(dtype, n, scale) -> None:
    """Fed the keystream words the CPU path reads (a chunk's radii's 64-bit words, then its
    angles'), the torch construction gives the CPU path's normals, to a few units in the last
    place of the largest (the logarithm, sine and cosine kernels differ)."""
    key, width, pairs = bytes(range(7, 23)), normal.ANGLE_BYTES[dtype], (n + 1) // 2
    raw = Keystream(key).read(0, (8 + width) * pairs)
    radius_words = torch.from_numpy(raw[: 8 * pairs].view(np.int64).copy())
    angle_words = torch.from_numpy(raw[8 * pairs :].view(f"i{width}").copy())
    made = normal.box_muller(radius_words, angle_words, torch.empty(n, dtype=dtype), scale)
    expected = _cpu_draw(key, n, dtype, scale)
    ulp = np.finfo(expected.dtype).eps
    np.testing.assert_allclose(made.numpy(), expected, rtol=0, atol=8 * ulp * TAIL * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_radii_and_angles_match_numpys_on_extreme_and_random_words(dtype) -> None:
    """Every word the stream can give, the extremes included: v = 2⁻⁵³ (the 8.57σ radius),
    v = 1 (radius 0), k = ±2ᵇ⁻¹ (θ = −π and just below π)."""
    rng, width = np.random.default_rng(0), normal.ANGLE_BYTES[dtype]
    info = np.iinfo(np.int64)
    extreme = [*SMALLEST_V, info.max, -(2**11), 0, -1]
    words = np.concatenate([extreme, rng.integers(info.min, info.max, 10_000, endpoint=True)])
    out = np.empty(len(words), np.float32 if width == 4 else np.float64)
    expected = gaussian.radii(words.copy(), out=out).copy()
    made = normal.radii(torch.from_numpy(words.copy()), out=torch.empty(len(words), dtype=dtype))
    np.testing.assert_allclose(made.numpy(), expected, rtol=4 * np.finfo(out.dtype).eps)
    assert made[:2].tolist() == pytest.approx([TAIL, TAIL], rel=1e-6)
    assert made[2].item() == 0.0
    small = np.iinfo(f"i{width}")
    random = rng.integers(small.min, small.max, 10_000, endpoint=True, dtype=small.dtype)
    angle_words = np.concatenate([np.array([small.min, small.max, 0, -1], small.dtype), random])
    expected = gaussian.angles(angle_words.copy(), out=np.empty(len(angle_words), out.dtype))
    made = normal.angles(torch.from_numpy(angle_words))
    assert made.dtype == dtype
    assert np.array_equal(made.numpy(), expected)  # exact: k times a constant, in one dtype
    assert made[0].item() == pytest.approx(-math.pi, rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_the_smallest_uniform_reaches_the_tail_through_the_device_path(
    dtype, scale, monkeypatch
) -> None:
    """Words whose v is 2⁻⁵³, at θ = 0 and θ = −π, give ±8.57σ (beyond 8.5σ: 32-bit uniforms
    stop at 6.66σ, curand's normal_ at 6.76σ), through the whole device path: its words, its
    layout, its scale and its half-precision rounding."""
    pairs, angle_type = 4, torch.int64 if dtype == torch.float64 else torch.int32

    def chosen(count: int, generator: torch.Generator) -> torch.Tensor:
        drawn = torch.zeros(count, dtype=torch.int64)
        drawn[:pairs] = SMALLEST_V[1]
        drawn[pairs:].view(angle_type)[1::2] = torch.iinfo(angle_type).min  # θ = −π
        return drawn

    monkeypatch.setattr(normal, "words", chosen)
    out = normal.normal_(torch.empty(2 * pairs - 1, dtype=dtype), torch.Generator(), scale)
    assert out.dtype == dtype
    cosines = [TAIL * scale, -TAIL * scale] * 2
    assert out[:pairs].double().tolist() == pytest.approx(cosines, rel=1e-2)
    assert out.max().item() > 8.5 * scale and out.min().item() < -8.5 * scale
    assert out[pairs:].abs().max().item() < 1e-5 * scale  # sines of 0 and −π


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_device_path_draws_standard_normals(dtype, monkeypatch) -> None:
    """10⁶ draws on CPU tensors through the device path, in parts of 2¹⁴ pairs (an odd total:
    the last part drops its last sine): mean, variance and Kolmogorov–Smirnov; every place
    written."""
    monkeypatch.setattr(normal, "DEVICE_PAIRS", 1 << 14)
    out = torch.full((1_000_001,), math.nan, dtype=dtype)
    z = normal.normal_(out, torch.Generator().manual_seed(1)).double().numpy()
    assert np.isfinite(z).all()
    assert abs(z.mean()) < 5e-3 and abs(z.std() - 1) < 5e-3
    assert stats.kstest(z, "norm").pvalue > 1e-4


def _bit_frequencies(words: torch.Tensor) -> np.ndarray:
    """How often each of the 64 bits of int64 ``words`` is set."""
    bits = words.cpu().numpy().view(np.uint8).reshape(-1, 8)
    return np.unpackbits(bits, axis=1, bitorder="little").mean(axis=0)


def _assert_64_random_bits(words: torch.Tensor) -> None:
    """Each bit set half the time, within 6 standard deviations: 64 random bits a word, not a
    32-bit draw widened (a range under 2³² leaves the top bits constant)."""
    assert np.abs(_bit_frequencies(words) - 0.5).max() < 6 * 0.5 / math.sqrt(len(words))


def test_device_words_carry_64_random_bits() -> None:
    _assert_64_random_bits(normal.words(200_000, torch.Generator().manual_seed(2)))


@cuda
def test_cuda_noise_reaches_the_tail_of_53_bit_uniforms(monkeypatch) -> None:
    """The attack: CUDA noise drawn through ``SecureStream.normal`` must be the 53-bit
    construction (its smallest v gives 8.57σ), not curand's truncated ``normal_``."""

    def chosen(count: int, generator: torch.Generator) -> torch.Tensor:
        assert generator.device.type == "cuda"
        drawn = torch.zeros(count, dtype=torch.int64, device=generator.device)
        drawn[:2] = SMALLEST_V[0]
        return drawn

    monkeypatch.setattr(normal, "words", chosen)
    z = SecureStream().normal(4, device="cuda", dtype=torch.float32)
    assert z.device.type == "cuda"
    assert z.max().item() == pytest.approx(TAIL, rel=1e-6)


@cuda
def test_cuda_words_carry_64_random_bits() -> None:
    generator = SecureStream()._device_generator(torch.device("cuda"))
    _assert_64_random_bits(normal.words(1_000_000, generator))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_noise_is_standard_normal(dtype) -> None:
    z = SecureStream().normal(1_000_001, device="cuda", dtype=dtype, scale=2.0)
    assert z.dtype == dtype and z.device.type == "cuda"
    z = z.double().cpu().numpy() / 2
    assert abs(z.std() - 1) < 5e-3
    if dtype != torch.bfloat16:  # its 8-bit significand fails the test on discreteness alone
        assert stats.kstest(z, "norm").pvalue > 1e-4


@cuda
def test_cuda_noise_has_the_gaussian_tail_frequency() -> None:
    """P(|Z| > 5) of 2·10⁸ draws on the GPU against 2·Φ(−5), within 5 binomial deviations."""
    stream, n, beyond = SecureStream(), 2 * 10**8, 0
    out = torch.empty(10**7, device="cuda")
    for _ in range(n // len(out)):
        beyond += (stream.normal(len(out), out=out).abs() > 5).sum().item()
    p = 2 * stats.norm.sf(5)
    assert abs(beyond - n * p) < 5 * math.sqrt(n * p)


@cuda
def test_cuda_initialisation_is_keyed_with_64_bits() -> None:
    """Philox keeps a 64-bit seed: the trial's seeding gives a fresh one, and an offset."""
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.cuda.default_generators[device.index]
    seeds = []
    for _ in range(2):
        TrialRandomness().seed_torch(device)
        seeds.append(generator.initial_seed())
        assert generator.get_offset() % 4 == 0
    assert seeds[0] != seeds[1]
    assert max(seeds) >= 2**32  # fails with probability 2⁻⁶⁴
    assert torch.rand(4, device=device).unique().numel() == 4
