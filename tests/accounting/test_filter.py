"""The dataset's privacy filter (``core.accounting.filter``), against independent computation:
its order against dp-accounting's Gaussian accountant, its ε against dp-accounting's conversion
at that one order, and the theorem itself on exact discrete games, where an analyst picks each
next mechanism from what the earlier ones released and the filter admits or stops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from core.accounting import ORDERS, PAIR_DELTA_SHARE, Filter, filter_order, rdp_curve
from core.accounting import filter as filter_module


def gaussian_best_order(epsilon: float, delta: float) -> float:
    """dp-accounting's own: the σ whose Gaussian mechanism converts to ``epsilon`` at
    ``delta``, and the order where it does."""

    def convert(sigma: float) -> tuple[float, float]:
        accountant = rdp_lib.RdpAccountant(orders=list(ORDERS))
        accountant.compose(dp_event.GaussianDpEvent(sigma))
        return accountant.get_epsilon_and_optimal_order(delta)

    sigma = brentq(lambda s: convert(s)[0] - epsilon, 1e-3, 1e4, xtol=1e-12)
    return float(convert(sigma)[1])


@pytest.mark.parametrize("epsilon", [0.3, 1.0, 2.0, 4.0, 8.0, 16.0, 50.0])
@pytest.mark.parametrize("delta", [1e-8, 1e-5, 1e-3])
def test_the_order_is_where_a_gaussian_spending_the_budget_converts_best(
    epsilon: float, delta: float
) -> None:
    assert filter_order(epsilon, delta) == gaussian_best_order(
        epsilon, (1 - PAIR_DELTA_SHARE) * delta
    )


@settings(max_examples=60, deadline=None)
@given(
    budget=st.floats(0.1, 64.0),
    runs=st.lists(
        st.tuples(st.floats(1e-3, 1.0), st.floats(0.5, 20.0), st.integers(1, 2000)),
        min_size=1,
        max_size=4,
    ),
    pairs=st.lists(st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 1e-7)), max_size=3),
)
def test_the_spent_epsilon_is_dp_accountings_conversion_at_the_one_order(
    budget: float, runs: list[tuple[float, float, int]], pairs: list[tuple[float, float]]
) -> None:
    """Curves read at the dataset's order only (never the smallest over orders), converted at
    the δ the pairs may not hold, the pairs' εs added, whatever the curves' shapes."""
    delta = 1e-5
    rule = Filter(budget, delta)
    curve = sum(rdp_curve(q, sigma, steps) for q, sigma, steps in runs)
    pair_epsilon, pair_delta = sum(e for e, _ in pairs), sum(d for _, d in pairs)
    order = filter_order(budget, delta)
    [i] = np.flatnonzero(order == ORDERS)
    at_order, _ = rdp_lib.compute_epsilon([order], [curve[i]], 0.9 * delta)
    got = rule.spent(curve, pair_epsilon, pair_delta)
    assert got == pytest.approx(at_order + pair_epsilon, rel=1e-12, abs=1e-12)
    assert got >= rdp_lib.compute_epsilon(ORDERS, curve, delta)[0] + pair_epsilon - 1e-9


def test_pairs_alone_compose_basically_and_hold_at_most_their_share() -> None:
    rule = Filter(2.0, 1e-5)
    zero = np.zeros_like(ORDERS)
    assert rule.spent(zero, 0.0, 0.0) == 0.0
    assert rule.spent(zero, 1.75, 1e-6) == 1.75  # no conversion while no curve is counted
    assert rule.spent(zero, 1.75, PAIR_DELTA_SHARE * 1e-5) == 1.75
    assert rule.spent(zero, 0.1, PAIR_DELTA_SHARE * 1e-5 * (1 + 1e-9)) == math.inf


# -- the theorem on exact games -------------------------------------------------------------


def randomized_response(epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    return np.array([p, 1 - p]), np.array([1 - p, p])


def canonical_pair(epsilon: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Kairouz, Oh & Viswanath's mechanism: every (ε, δ) mechanism is a post-processing of it."""
    e = math.exp(epsilon)
    p = [delta, (1 - delta) * e / (1 + e), (1 - delta) / (1 + e), 0.0]
    return np.array(p), np.array(p[::-1])


def rr_curve(epsilon: float) -> np.ndarray:
    """RDP of randomized response at every order, in closed form."""
    p, q = randomized_response(epsilon)
    terms = np.logaddexp(
        ORDERS * math.log(p[0]) + (1 - ORDERS) * math.log(q[0]),
        ORDERS * math.log(p[1]) + (1 - ORDERS) * math.log(q[1]),
    )
    return terms / (ORDERS - 1)


#: what the analyst may ask for: randomized response counted by its curve, and canonical (ε, δ)
#: mechanisms counted as pairs; the last pair's δ is more than all pairs may hold
MENU: list[tuple[str, float, float]] = [
    ("curve", 0.05, 0.0),
    ("curve", 0.25, 0.0),
    ("curve", 0.6, 0.0),
    ("pair", 0.1, 0.0015),
    ("pair", 0.3, 0.001),
    ("pair", 0.05, 0.02),
]


def hockey_stick(
    budget: float, delta: float, seed: int, favourite: int, depth: int = 7
) -> tuple[float, float]:
    """Both directions of sup_S P(S) − e^ε Q(S) over whole transcripts, exactly: after each
    history the analyst asks for its favourite menu item or another, as hash(seed, history)
    says; the filter admits it or the game ends."""
    rule = Filter(budget, delta)
    leaves: list[tuple[float, float]] = []

    def play(
        history: tuple[int, ...], p: float, q: float, curve: np.ndarray, pe: float, pd: float
    ) -> None:
        pick = hash((seed, history)) % (2 * len(MENU))
        kind, epsilon, d = MENU[favourite if pick >= len(MENU) else pick]
        after = (
            (curve + rr_curve(epsilon), pe, pd)
            if kind == "curve"
            else (curve, pe + epsilon, pd + d)
        )
        if len(history) == depth or rule.spent(*after) > budget:
            leaves.append((p, q))
            return
        pm, qm = randomized_response(epsilon) if kind == "curve" else canonical_pair(epsilon, d)
        for out, (po, qo) in enumerate(zip(pm, qm, strict=True)):
            if po or qo:
                play((*history, out), p * po, q * qo, *after)

    play((), 1.0, 1.0, np.zeros_like(ORDERS), 0.0, 0.0)
    p, q = np.array(leaves).T
    e = math.exp(budget)
    return float(np.maximum(p - e * q, 0).sum()), float(np.maximum(q - e * p, 0).sum())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    favourite=st.integers(0, len(MENU) - 1),
    budget=st.sampled_from([0.5, 1.0, 1.5]),
)
def test_no_analyst_strategy_breaks_the_filter_on_exact_games(
    seed: int, favourite: int, budget: float
) -> None:
    delta = 0.05
    forward, backward = hockey_stick(budget, delta, seed, favourite)
    assert forward <= delta and backward <= delta


def test_the_exact_games_catch_a_filter_that_forgets_the_pairs_delta_or_the_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The games can fail: without the pairs' share of δ, or without the conversion, some
    strategy goes above δ."""
    delta, budget = 0.05, 1.0

    def worst() -> float:
        games = [(s, f) for s in range(10) for f in range(len(MENU))]
        return max(max(hockey_stick(budget, delta, s, f)) for s, f in games)

    assert worst() <= delta
    spent = Filter.spent
    with monkeypatch.context() as m:
        m.setattr(Filter, "spent", lambda self, c, pe, pd: spent(self, c, pe, 0.0))
        assert worst() > delta
    with monkeypatch.context() as m:
        m.setattr(filter_module, "conversion", lambda order, d: 0.0)
        assert worst() > delta
