"""Threshold rules of paper 001 and its baselines, checked against independent computations."""

import math

import numpy as np
import pytest
import torch

from core.config import AdaptiveConfig, MethodConfig
from core.noise import release_noise
from workers.dp.adaptive import (
    DecayRule,
    QuantileRule,
    build_rule,
    cautious_range,
    error_threshold,
    noisy_histogram,
    percentile_threshold,
)
from workers.dp.randomness import SecureStream


def synthetic(seed=0):
    """Paper 001, Fig. 2: 256 draws from N(100, 20²)."""
    return torch.tensor(np.random.default_rng(seed).normal(100, 20, 256))


def test_histogram_counts_and_overflow_bin():
    norms = torch.tensor([0.0, 0.49, 0.5, 1.7, 2.0, 9.0, float("nan"), float("inf")])
    hist = noisy_histogram(norms, 2.0, 4, 0.0, SecureStream())
    assert hist.tolist() == [2, 1, 0, 5]  # bins of width 0.5; ≥ 2 (or not finite) in the last
    noisy = noisy_histogram(norms, 2.0, 4, 3.0, SecureStream())
    assert not torch.equal(noisy, hist)


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dcsgd_p_lands_within_a_bin_of_the_true_percentile(p, seed):
    norms, range_, bins = synthetic(seed), 200.0, 20
    hist = noisy_histogram(norms, range_, bins, 0.1, SecureStream())
    estimate = percentile_threshold(hist, range_, p)
    assert abs(estimate - np.quantile(norms.numpy(), p)) <= range_ / bins


def test_dcsgd_p_rule_sets_range_to_twice_the_threshold():
    cfg = MethodConfig(adaptive=AdaptiveConfig(rule="dcsgd_p", histogram_noise=0.01))
    rule = build_rule(
        cfg, expected_batch_size=256, steps=10, grad_noise=1.0, num_params=10, stream=SecureStream()
    )
    assert (rule.threshold, rule.range) == (1.0, 1.0)  # C₀ = 1, R₀ = 1
    for _ in range(8):  # the range grows geometrically until it covers the median
        rule.update(synthetic(), 0)
        assert rule.range == pytest.approx(2 * rule.threshold)
    assert abs(rule.threshold - float(synthetic().median())) <= rule.range / 20


def brute_force_error(norm_estimates, weights, candidates, a):
    """Eq. 4 evaluated term by term, independently of the implementation."""
    total = sum(weights)
    errors = []
    for c in candidates:
        bias = sum(w * max(g - c, 0.0) ** 2 for g, w in zip(norm_estimates, weights, strict=True))
        errors.append(a * c * c + bias / total)
    return candidates[int(np.argmin(errors))]


def grid(centre):
    return [i * centre / 10 for i in range(1, 21)]


MIDS = [(k + 0.5) * 12.0 for k in range(20)]  # bins of [0, 240]


@pytest.mark.parametrize("a", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 3])
def test_dcsgd_e_picks_the_brute_force_minimiser_on_a_noiseless_histogram(a, seed):
    hist = noisy_histogram(synthetic(seed), 240.0, 20, 0.0, SecureStream())
    expected = brute_force_error(MIDS, hist.tolist(), grid(100.0), a)
    assert expected not in (grid(100.0)[0], grid(100.0)[-1])
    assert error_threshold(hist, 240.0, 100.0, a) == pytest.approx(expected)


def test_dcsgd_e_recentres_on_a_boundary_minimiser():
    hist = noisy_histogram(synthetic(), 240.0, 20, 0.0, SecureStream())
    weights, start, a = hist.tolist(), 5.0, 0.3
    chosen = error_threshold(hist, 240.0, start, a)
    centres = [start * 2**k for k in range(12)]
    k = next(
        k
        for k, c in enumerate(centres)
        if brute_force_error(MIDS, weights, grid(c), a) not in (grid(c)[0], grid(c)[-1])
    )
    assert k > 0  # the first grid's minimiser was its upper boundary: 2C, then 4C, …
    assert all(brute_force_error(MIDS, weights, grid(c), a) == grid(c)[-1] for c in centres[:k])
    assert chosen == pytest.approx(brute_force_error(MIDS, weights, grid(centres[k]), a))


def test_dcsgd_e_search_stops_below_the_histogram_resolution():
    # Negative noisy mass at large norms makes eq. 4 increase from C = 0: the literal search
    # would shrink C by 10× per round without end.
    hist = torch.zeros(20, dtype=torch.float64)
    hist[0], hist[-1] = 5.0, -4.0
    chosen = error_threshold(hist, 20.0, 1.0, 1e-3)
    assert 0.05 <= chosen < 0.5  # first midpoint 0.5: one recentring below it, then stop


def test_cautious_range_update():
    assert cautious_range(torch.tensor([1.0, 1, 1, 10]), 8.0) == 16.0  # overflow ≥ half
    assert cautious_range(torch.tensor([10.0, 5, 0, 0.5]), 8.0) == 4.0  # right half ≤ S′/b
    assert cautious_range(torch.tensor([4.0, 4, 4, 4]), 8.0) == 8.0


def test_andrew_geometric_quantile_update():
    rule = QuantileRule(
        2.0,
        target=0.3,
        learning_rate=0.2,
        count_noise=1e-9,
        expected_batch_size=8,
        stream=SecureStream(),
    )
    norms = torch.tensor([0.5, 1.0, 1.5, 2.5, 3.0, 4.0, 5.0, 6.0])  # 3 of 8 unclipped
    rule.update(norms, 0)
    assert rule.threshold == pytest.approx(2.0 * math.exp(-0.2 * (3 / 8 - 0.3)))
    assert rule.release_noise == 2e-9


def test_du_decay_schedule():
    rule = DecayRule(1.5, decay=0.5, total_steps=4)
    seen = []
    for t in range(4):
        seen.append(rule.threshold)
        rule.update(torch.zeros(3), t)
    assert seen == pytest.approx([1.5 * 0.5 ** (t / 4) for t in range(4)])


def test_release_noise_per_rule():
    def method(**kw):
        return MethodConfig(adaptive=AdaptiveConfig(**kw))

    assert release_noise(MethodConfig(), 64) is None
    assert release_noise(method(rule="du"), 64) is None
    assert release_noise(method(rule="dcsgd_e", histogram_noise=7.0), 64) == 7.0
    assert release_noise(method(rule="andrew"), 64) == pytest.approx(2 * 64 / 20)
    assert release_noise(method(rule="andrew", count_noise=4.0), 64) == 8.0
    e = build_rule(
        method(rule="dcsgd_e"),
        expected_batch_size=50,
        steps=3,
        grad_noise=2.0,
        num_params=1000,
        stream=SecureStream(),
    )
    assert e.range == 20.0  # R₀ = b
    assert e.variance_coef == pytest.approx(4.0 * 1000 / 2500)
