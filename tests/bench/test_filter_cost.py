"""The order a dataset's filter reads curves at (``core.accounting.filter_order``), against the
conversion's closed form minimised over continuous orders; and ``bench/filter_cost.py`` on a few
random job sequences: the filter admits no more jobs than the smallest-over-orders rule, and
counting jobs as pairs where that takes less room admits as many as curves alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from core.accounting import ORDERS, PAIR_DELTA_SHARE, filter_order


def gaussian_epsilon(rho: float, alpha: float, delta: float) -> float:
    """ε at δ of the curve ρ·α at order α: ρα + ln(1 − 1/α) − (ln δ + ln α)/(α − 1) (Balle et
    al. 2020, Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12)."""
    return rho * alpha + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)


@pytest.mark.parametrize("budget", [1.0, 4.0, 16.0])
def test_the_filter_order_is_the_gaussians_best(budget: float) -> None:
    alpha = filter_order(budget, 1e-5)
    delta = (1 - PAIR_DELTA_SHARE) * 1e-5  # the curves' δ
    grid = ORDERS[(alpha / 1.5 <= ORDERS) & (alpha * 1.5 >= ORDERS)]

    def best(rho: float) -> float:  # the grid's best ε of the curve ρ·α
        return min(gaussian_epsilon(rho, a, delta) for a in ORDERS)

    lo, hi = 1e-8, budget
    for _ in range(80):  # bisection: ρ at which the grid's best ε is the budget
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid) < budget else (lo, mid)
    continuous = minimize_scalar(
        lambda a: gaussian_epsilon(lo, a, delta), bounds=(1.01, 2000), method="bounded"
    ).x
    assert alpha in grid
    nearest = ORDERS[np.argsort(np.abs(ORDERS - continuous))[:2]]
    assert alpha in nearest  # the grid's best order is one of the two around the true optimum


def test_the_filter_admits_no_more_than_the_smallest_over_orders(bench, capsys) -> None:
    out = bench("filter_cost").main(["--budgets", "2", "8", "--sequences", "4"])
    for counts in out.values():
        assert 0 < counts["filter"] <= counts["earlier"], out
        assert counts["filter"] >= counts["filter, curves only"], out
    assert "| 2 | filter |" in capsys.readouterr().out
