"""The one-run bound (core.accounting.audit) against an independent computation.

The reference below is written from the statement of Steinke, Nasr, Jagielski (2023),
Theorem 5.2, with exact binomial terms (math.comb, math.fsum, no scipy) and a brute-force grid
search over ε instead of bisection.
"""

import math

import numpy as np
import pytest

from core.accounting.audit import correct_guesses, epsilon_lower_bound, p_value

GRID_STEP = 0.005


def reference_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    pmf = [math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]
    tail = math.fsum(pmf[v:])  # P[Bin(r, q) ≥ v]
    alpha, below = 0.0, 0.0
    for i in range(1, v + 1):
        below += pmf[v - i]  # P[v − i ≤ Bin(r, q) < v]
        alpha = max(alpha, below / i)
    return min(1.0, tail + 2 * m * delta * alpha)


def reference_bound(m: int, r: int, v: int, delta: float, significance: float = 0.05) -> float:
    """Largest ε on the grid whose claim is rejected (0 when none is)."""
    rejected = [
        k * GRID_STEP
        for k in range(int(8 / GRID_STEP))
        if reference_p_value(m, r, v, k * GRID_STEP, delta) <= significance
    ]
    return max(rejected, default=0.0)


CASES = [  # m, r, v, delta
    (1000, 200, 145, 1e-5),
    (1000, 200, 200, 1e-5),
    (1000, 200, 120, 1e-5),
    (1000, 100, 60, 0.0),
    (1000, 200, 100, 1e-5),
    (100, 50, 50, 1e-3),
    (2000, 400, 300, 1e-6),
    (1000, 200, 190, 1e-4),
]


@pytest.mark.parametrize(("m", "r", "v", "delta"), CASES)
def test_p_value_matches_the_reference(m, r, v, delta):
    for epsilon in (0.0, 0.3, 1.0, 2.5, 5.0):
        assert p_value(m, r, v, epsilon, delta) == pytest.approx(
            reference_p_value(m, r, v, epsilon, delta), rel=1e-9, abs=1e-12
        )


@pytest.mark.parametrize(("m", "r", "v", "delta"), CASES)
def test_bound_matches_a_brute_force_search(m, r, v, delta):
    ours = epsilon_lower_bound(m, r, v, delta)
    brute = reference_bound(m, r, v, delta)
    assert brute - 1e-6 <= ours < brute + GRID_STEP
    if ours > 0:  # the bound is the edge of the rejected claims
        assert reference_p_value(m, r, v, ours, delta) <= 0.05
        assert reference_p_value(m, r, v, ours + 1e-4, delta) > 0.05


def test_bound_is_valid_for_the_worst_case_mechanism():
    """ε-randomized response on every canary makes each guess right with probability
    e^ε/(1 + e^ε), independently: the mechanism the theorem's tail is tight for. The chance
    that the bound exceeds the true ε must stay below 5%, computed exactly over v."""
    r, m = 200, 1000
    for epsilon in (0.5, 1.0, 2.0, 4.0):
        q = math.exp(epsilon) / (1 + math.exp(epsilon))
        refuting = [v for v in range(r + 1) if epsilon_lower_bound(m, r, v, 1e-5) > epsilon]
        chance = math.fsum(math.comb(r, v) * q**v * (1 - q) ** (r - v) for v in refuting)
        assert 0 < chance <= 0.05


def test_more_correct_guesses_never_lower_the_bound():
    bounds = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(90, 201, 5)]
    assert bounds == sorted(bounds)
    assert bounds[0] == 0
    assert epsilon_lower_bound(1000, 200, 200, 1e-5) == pytest.approx(
        reference_bound(1000, 200, 200, 1e-5), abs=GRID_STEP
    )


def test_guesses_take_both_tails():
    included = np.array([True, True, False, True, False, False, True, False])
    scores = np.array([9.0, 8.0, 0.0, 7.0, 1.0, 2.0, 6.0, 3.0])
    assert correct_guesses(scores, included, 8) == 8  # top 4 in, bottom 4 out
    assert correct_guesses(-scores, included, 8) == 0
    assert correct_guesses(scores, included, 3) == 3  # ⌈3/2⌉ = 2 "in" and 1 "out"
    assert correct_guesses(np.zeros(8), included, 2) == 2  # ties: the first "in", the last "out"


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="guesses"):
        epsilon_lower_bound(100, 200, 150, 1e-5)
    with pytest.raises(ValueError, match="guesses"):
        correct_guesses(np.zeros(5), np.zeros(5, dtype=bool), 6)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(1000, 200, 150, 1e-5, confidence=1.5)
