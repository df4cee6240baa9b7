"""Randomness that protects privacy cannot be reproduced (docs/design.md, invariant 8).

The attacks these stop: with a trial seed fed to torch's CPU generator (which keeps only its
low 32 bits), seeds that agree in their low 32 bits gave identical noise, and one released
noisy score let an attacker search every seed and subtract the noise. A fixed-size hold-out
and float32 Poisson sampling broke the coupling the accountant assumes. The model's
initialisation was seeded the same way, so 32 bits determined the initial weights.
"""

from __future__ import annotations

import io
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from core.config import TrialConfig
from core.entropy import Keystream, Reader, buffer
from workers import gaussian, trial
from workers.data import Dataset, hold_out
from workers.dp.randomness import SecureStream, TrialRandomness, spare_core
from workers.dp.sampling import poisson_batches
from workers.trial import run_trial

TINY = {
    "dataset": {"source": "builtin:digits"},
    "model": {"name": "logreg"},
    "epochs": 0.2,
    "batch_size": 64,
    "noise_multiplier": 1.0,
    "device": "cpu",
    "method": {"per_sample": "general"},
    "validation": {"split": "private", "noise": 1.0, "fraction": 0.2},
}


def _reset_global_rngs() -> None:
    """Everything an attacker could reproduce: every global generator in a known state."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def test_no_seed_reaches_a_trial() -> None:
    assert "seed" not in TrialConfig.model_fields  # nothing stored can replay a trial
    with pytest.raises(ValueError, match="seed"):
        TrialConfig.model_validate({**TINY, "seed": 2**32 + 7})


def test_identical_trials_draw_different_noise_whatever_the_global_state() -> None:
    """The old attack: seeds s and s + 2³² (same low 32 bits) trained the same model and
    released the same noisy score. Now two trials with identical configs and identical global
    generator states still differ in every private draw."""
    cfg = TrialConfig.model_validate(TINY)
    outcomes = []
    for _ in range(2):
        _reset_global_rngs()
        outcomes.append(run_trial(cfg))
    first, second = (o.result["score"]["value"] for o in outcomes)
    assert first != second
    weights = [torch.cat([p.detach().flatten() for p in o.model.parameters()]) for o in outcomes]
    assert not torch.equal(weights[0], weights[1])


def test_streams_are_independent_and_not_reproducible() -> None:
    draws = []
    for _ in range(2):
        _reset_global_rngs()
        r = TrialRandomness()
        draws.append([r.sampling.uniform(8), r.gradient.normal(8), r.holdout.uniform(8)])
    for a, b in zip(*draws, strict=True):
        assert not torch.equal(a, b)
    one = TrialRandomness()  # streams of one trial differ from each other too
    assert not torch.equal(one.sampling.uniform(8), one.holdout.uniform(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gradient_noise_is_standard_normal(dtype: torch.dtype) -> None:
    z = SecureStream().normal(200_001, dtype=dtype)
    assert z.dtype == dtype
    if dtype != torch.bfloat16:  # its 8-bit significand fails the test on discreteness alone
        assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-4
    assert abs(z.double().std().item() - 1) < 0.01
    assert SecureStream().normal((3, 4), dtype=dtype).shape == (3, 4)


@pytest.mark.parametrize("t", [2.0, 3.0, 4.0, 4.5])
def test_gradient_noise_has_the_gaussian_tails(t: float) -> None:
    """Kolmogorov–Smirnov sees the bulk; the tails are where DP's bound lives: P(|Z| > t) of
    4·10⁶ draws against the closed form 2·Φ(−t), within 5 binomial standard deviations."""
    n = 4_000_000
    z = SecureStream().normal(n)
    p = 2 * stats.norm.sf(t)
    assert abs((z.abs() > t).sum().item() - n * p) < 5 * (n * p * (1 - p)) ** 0.5


def _aes_blocks(key: bytes, nbytes: int) -> bytes:
    """AES-CTR's keystream computed independently of OpenSSL's CTR mode: the block cipher
    alone (ECB) on the big-endian counter blocks 0, 1, 2, …"""
    blocks = -(-nbytes // 16)
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return ecb.update(b"".join(i.to_bytes(16, "big") for i in range(blocks)))[:nbytes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussians_are_box_muller_of_the_keystream(dtype: torch.dtype) -> None:
    """Each chunk of noise is r·cos θ then r·sin θ, r = √(−2 ln v) and θ = 2π·k·2⁻ᵇ, from the
    keystream in its order, read as signed little-endian integers: the chunk's radii's 64-bit
    words w (v = ((w >> 11) + 2⁵² + 1)·2⁻⁵³), then its angles' (k: the top b bits of 32-bit
    words, b = 24, for float32 noise; of 64-bit words, b = 53, for float64). To the bit, with
    the same functions in the same dtype; and within 8 units in the last place (of the largest
    draw, 8.6) of the same formula from Python's ``math`` in float64, so that the SIMD
    functions the product uses are checked against an independent computation. Drawn at a
    standard deviation s, the radii are multiplied by s before the cosines and sines."""
    key, s = bytes(range(16)), 0.37
    pairs = gaussian.CHUNK + 3  # a whole chunk, then a short one with an odd tail
    n = 2 * pairs - 1
    stream, scaled = SecureStream(), SecureStream()
    stream.keystream, scaled.keystream = Keystream(key), Keystream(key)
    z = stream.normal(n, dtype=dtype).numpy()
    zs = scaled.normal(n, dtype=dtype, scale=s).numpy()
    angle_bytes, bits = (4, 24) if dtype == torch.float32 else (8, 53)
    words = np.frombuffer(_aes_blocks(key, (8 + angle_bytes) * pairs), dtype=np.uint8)
    expected, expected_scaled, exact, start = [], [], [], 0
    for size in (gaussian.CHUNK, pairs - gaussian.CHUNK):
        w = words[start : start + 8 * size].view("<i8")
        a = words[start + 8 * size : start + (8 + angle_bytes) * size].view(f"<i{angle_bytes}")
        start += (8 + angle_bytes) * size
        m = (w >> 11) + 2**52 + 1  # uniform on 1, …, 2⁵³
        assert m.min() >= 1 and m.max() <= 2**53
        v = m.astype(np.float64) * 2.0**-53  # exact
        k = (a >> (8 * angle_bytes - bits)).astype(np.float64)  # exact: |k| ≤ 2ᵇ⁻¹
        typed = v.astype(z.dtype)
        radius = np.sqrt(np.log(typed) * z.dtype.type(-2.0))
        angle = k.astype(z.dtype) * z.dtype.type(2 * np.pi * 2.0**-bits)
        expected += [radius * np.cos(angle), radius * np.sin(angle)]
        radius *= z.dtype.type(s)
        expected_scaled += [radius * np.cos(angle), radius * np.sin(angle)]
        polar = [
            (math.sqrt(-2 * math.log(x)), 2 * math.pi * y * 2.0**-bits)
            for x, y in zip(typed.astype(np.float64), k, strict=True)
        ]
        exact += [[r * math.cos(t) for r, t in polar], [r * math.sin(t) for r, t in polar]]
    expected[-1], exact[-1] = expected[-1][:-1], exact[-1][:-1]
    expected_scaled[-1] = expected_scaled[-1][:-1]
    assert np.array_equal(z, np.concatenate(expected))
    assert np.array_equal(zs, np.concatenate(expected_scaled))
    ulp = np.finfo(z.dtype).eps
    assert np.abs(z - np.concatenate(exact)).max() <= 8 * ulp * 8.6
    assert np.abs(zs - s * np.concatenate(exact)).max() <= 9 * ulp * 8.6 * s


def test_sampling_compares_in_float64() -> None:
    """float32 uniforms are multiples of 2⁻²⁴, so ``u < q`` with a float32 ``u`` holds with
    probability ceil(q·2²⁴)/2²⁴ ≥ q — up to twice q for q near 2⁻²⁵. Secure uniforms are
    float64 with 53 bits, and the comparison with q is made in float64."""
    u = SecureStream().uniform(100_000)
    assert u.dtype == torch.float64
    assert (torch.frac(u * 2**24) != 0).float().mean() > 0.99  # finer than float32's grid

    class Fixed(SecureStream):  # test double: chosen uniforms around q
        def uniform(self, n: int) -> torch.Tensor:
            return torch.tensor([q - 2**-60, q, q + 2**-40], dtype=torch.float64)

    q = 2**-25 + 2**-50  # rounds to 2⁻²⁵ in float32
    (batch,) = poisson_batches(3, q, 1, Fixed())
    assert batch.tolist() == [0]


def test_realized_sample_rate_at_a_tiny_q() -> None:
    n, q, steps = 200_000, 3e-5, 50  # q·2²⁴ = 503.3: float32 rounding is within 0.1%
    sizes = np.array([len(b) for b in poisson_batches(n, q, steps, SecureStream())])
    assert abs(sizes.mean() - n * q) < 5 * np.sqrt(n * q / steps)


def _dataset(n: int) -> Dataset:
    return Dataset("synthetic", torch.randn(n, 3), torch.randint(0, 2, (n,)), 2)


def test_hold_out_size_is_binomial() -> None:
    """Each example is held out independently with probability f, so the hold-out size is
    Binomial(N, f) and adding one record leaves every other record's side unchanged. (The old
    hold-out always took round(f·N) examples: its size had variance 0.)"""
    n, f, runs = 200, 0.1, 2000
    data = _dataset(n)
    sizes = np.array([len(hold_out(data, f, SecureStream()).y_val) for _ in range(runs)])
    assert sizes.mean() == pytest.approx(n * f, abs=5 * np.sqrt(n * f * (1 - f) / runs))
    assert sizes.var() == pytest.approx(n * f * (1 - f), rel=0.15)
    edges = np.arange(10, 31)  # chi-square goodness of fit on the bulk of the pmf
    observed = np.array(
        [(sizes < 10).sum(), *[(sizes == k).sum() for k in edges[:-1]], (sizes >= 30).sum()]
    )
    pmf = stats.binom(n, f)
    expected = runs * np.array([pmf.cdf(9), *pmf.pmf(edges[:-1]), pmf.sf(29)])
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_hold_out_partitions_the_data() -> None:
    data = _dataset(500)
    split = hold_out(data, 0.3, SecureStream())
    together = torch.cat([split.x, split.x_val])
    assert len(together) == 500 and len(torch.unique(together, dim=0)) == 500
    assert split.splits == {"train": "private", "val": "private"}


class Chosen(Keystream):
    """Test double: a keystream that gives the bytes it was given, one piece a read."""

    def __init__(self, *pieces: bytes) -> None:
        super().__init__(bytes(16))
        self.pieces = list(pieces)

    def reader(self, start: int) -> Reader:
        return ChosenReader(self.pieces)


class ChosenReader(Reader):
    """Its readers: each read is the next piece."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def read(self, nbytes: int, into: np.ndarray) -> np.ndarray:
        piece = self.pieces.pop(0)
        assert nbytes == len(piece)
        into[:nbytes] = np.frombuffer(piece, dtype=np.uint8)
        return into[:nbytes]


@pytest.mark.parametrize(
    ("radius_word", "angle_word", "z"),
    [
        # words as unsigned: the most extreme v, 2⁻⁵³ (w = −2⁶³), at θ = 0 (k = 0): the largest
        # radius √(−2 ln 2⁻⁵³) ≈ 8.57σ
        (2**63, 0, (2 * 53 * np.log(2)) ** 0.5),
        # v = 1 (w = 2⁶³ − 1): radius 0
        (2**63 - 1, 2**31, 0.0),
        # v = 2⁻¹ (w = −2¹¹) at θ = −π (k = −2²³)
        (2**64 - 2**11, 2**31, -((2 * np.log(2)) ** 0.5)),
    ],
)
def test_box_muller_reaches_the_tails_of_53_bit_uniforms(radius_word, angle_word, z) -> None:
    """The largest radius Box–Muller can produce is √(−2 ln 2⁻⁵³) ≈ 8.57σ with 53-bit uniforms
    (6.66σ with 32-bit ones, a truncation the accountant does not price); v is never 0."""
    stream = SecureStream()
    stream.keystream = Chosen(radius_word.to_bytes(8, "little"), angle_word.to_bytes(4, "little"))
    (drawn,) = stream.normal(1).tolist()
    assert drawn == pytest.approx(z, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("start", [0, 5, 16, 37, 1000])
def test_the_keystream_read_anywhere_is_aes_of_the_counter_blocks(start: int) -> None:
    key = bytes(range(16))
    stream = Keystream(key)
    assert stream.claim(start) == 0 and stream.claim(50) == start
    read = stream.read(start, 50)
    assert read.ctypes.data % 8 == 0  # aligned for 8-byte words
    assert read.tobytes() == _aes_blocks(key, start + 50)[start:]
    reader, held = stream.reader(start), buffer(40)  # read on in parts, into one buffer
    parts = b"".join(reader.read(n, held).tobytes() for n in (1, 15, 17, 40))
    assert parts == _aes_blocks(key, start + 73)[start:]


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
def test_the_child_draws_its_streams_next_draws_into_the_shared_file(
    dtype, tmp_path, monkeypatch
) -> None:
    """``workers.gaussian.serve``, run here with its key replaced (a test double): one reply
    when started, then for each request the stream's next draw at the requested scale, into
    the shared file, and one reply; it ends with its requests."""
    key, size = b"the child's key!", 2 * gaussian.CHUNK + 5
    path = tmp_path / "shared"
    path.write_bytes(bytes(size * np.dtype(dtype).itemsize))
    replies = io.BytesIO()
    monkeypatch.setattr(gaussian, "Keystream", lambda: Keystream(key))
    monkeypatch.setattr(sys, "stdin", io.StringIO("0.5\n1.25\n"))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(replies))
    with path.open("r+b") as shared:
        gaussian.serve(shared.fileno(), size, dtype)
    assert replies.getvalue() == gaussian.READY + 2 * gaussian.MADE
    plain, torch_dtype = SecureStream(), torch.float32 if dtype == "<f4" else torch.float64
    plain.keystream = Keystream(key)
    plain.normal(size, dtype=torch_dtype, scale=0.5)
    expected = plain.normal(size, dtype=torch_dtype, scale=1.25)
    assert torch.equal(torch.from_numpy(np.fromfile(path, dtype=dtype)), expected)


@pytest.mark.parametrize("memfd", [True, False])
def test_a_noise_child_draws_into_the_buffer_it_shares(memfd, monkeypatch) -> None:
    """With anonymous shared memory (Linux), and without (macOS: an unlinked temporary file):
    each request's draw lands in the buffer this process reads, fresh each time."""
    if not memfd:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    child = SecureStream().child(50_000, torch.float64)
    deadline = time.monotonic() + 30
    while not child.ready():
        assert time.monotonic() < deadline, "the noise child did not start"
        time.sleep(0.01)
    drawn = []
    for scale in (1.0, 0.25):
        child.request(scale)
        child.wait()
        drawn.append(child.flat.clone())
    for scale, z in zip((1.0, 0.25), drawn, strict=True):
        assert stats.kstest(z.numpy() / scale, "norm").pvalue > 1e-4


def test_the_child_imports_no_torch() -> None:
    """It starts in a fraction of the time torch takes to import."""
    check = "import sys, workers.gaussian; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_stream_whose_draws_a_subclass_changes_has_no_child() -> None:
    class Doubled(SecureStream):  # test double
        def normal(self, shape, **kwargs):
            return 2 * super().normal(shape, **kwargs)

    assert Doubled().child(1000, torch.float32) is None
    assert SecureStream().child(1000, torch.float16) is None  # half precision: in line
    assert SecureStream().child(0, torch.float32) is None


def test_noise_is_drawn_ahead_only_with_a_core_to_spare() -> None:
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(cores)
        assert not spare_core()
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert spare_core()
    finally:
        torch.set_num_threads(threads)


def _mt19937(state: torch.Tensor) -> tuple[int, int, np.ndarray]:
    """``left``, ``next`` and the 624 state words of torch's CPU generator state, read from its
    layout (``CPUGeneratorImplState`` in ATen: int32 ``left`` at byte 8, uint64 ``next`` at 16,
    the words in uint64 slots from byte 24)."""
    raw = state.numpy()
    left, following = raw[8:12].view("<i4")[0], raw[16:24].view("<u8")[0]
    return int(left), int(following), raw[24 : 24 + 8 * 624].view("<u8")


def _seeding_recurrence_holds(words: np.ndarray) -> np.ndarray:
    """Where mt19937's seeding recurrence (``init_genrand``, which ``torch.manual_seed`` runs on
    a seed's low 32 bits) holds between consecutive words: everywhere in a state that a 32-bit
    seed fixed, at random places (2⁻³² each) in a state of independent words."""
    previous, index = words[:-1] & 0xFFFFFFFF, np.arange(1, len(words), dtype=np.uint64)
    expected = (
        np.uint64(1812433253) * (previous ^ (previous >> np.uint64(30))) + index
    ) & 0xFFFFFFFF
    return expected == words[1:]


class _Built(Exception):
    """Raised where a trial builds its model: the test has what it came for."""


def test_a_trials_initialisation_is_not_determined_by_32_bits(monkeypatch) -> None:
    """The attack: ``torch.manual_seed`` of the trial's 63-bit seed kept its low 32 bits, so the
    CPU generator that initialises the model was one of 2³² states (each word fixed by the one
    before it), and the initial weights could be searched. Where the trial builds its model,
    the generator's 624 words now come from the secure stream."""
    states = []

    def build(*args: object, **kwargs: object) -> None:
        states.append(torch.get_rng_state())
        raise _Built

    monkeypatch.setattr(trial, "build_model", build)
    for _ in range(2):
        with pytest.raises(_Built):
            run_trial(TrialConfig.model_validate(TINY))
    (_, _, first), (_, _, second) = (_mt19937(state) for state in states)
    for words in (first, second):
        assert _seeding_recurrence_holds(words).sum() <= 2
    assert (first[1:] != second[1:]).mean() > 0.99


def test_seeding_torch_writes_the_init_streams_words_into_the_whole_state() -> None:
    """All 19,937 bits of mt19937's state are the init stream's words (the first word's top
    bit set, as ``init_by_array`` does: the recurrence reads no other bit of it, and the state
    cannot be all zeros); ``left`` = 1 and ``next`` = 0 make a valid generator that regenerates
    the whole state before its first output."""
    key = bytes(range(40, 56))
    randomness = TrialRandomness()
    randomness.init.keystream = Keystream(key)
    randomness.seed_torch(torch.device("cpu"))
    left, following, words = _mt19937(torch.get_rng_state())
    drawn = np.frombuffer(_aes_blocks(key, 4 * 624), dtype="<u4").astype(np.uint64)
    assert (left, following) == (1, 0)
    assert np.array_equal(words[1:], drawn[1:])
    assert words[0] == drawn[0] | 0x8000_0000


def test_after_seeding_torch_draws_uniforms_and_each_seeding_a_new_model() -> None:
    models, draws = [], []
    for _ in range(2):
        _reset_global_rngs()
        TrialRandomness().seed_torch(torch.device("cpu"))
        models.append(torch.nn.Linear(20, 5).weight.detach().clone())
        draws.append(torch.rand(100_000, dtype=torch.float64))
        assert stats.kstest(draws[-1].numpy(), "uniform").pvalue > 1e-4
        assert abs(torch.randn(100_000).std().item() - 1) < 0.02
    assert not torch.equal(*models)
    assert not torch.equal(*draws)
