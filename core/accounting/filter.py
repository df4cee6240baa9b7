"""A dataset's budget as a privacy filter: the rule that admits jobs chosen after earlier releases.

An analyst chooses each job's ε and shape after reading the earlier jobs' models, so admitting
a job while the dataset's total stays within its budget is a *privacy filter* under fully
adaptive composition (Rogers, Roth, Ullman & Vadhan, "Privacy Odometers and Filters", NeurIPS
2016). Composing RDP curves and taking the smallest ε over the orders is not a filter proven at
(ε, δ); composing PLDs is not a valid filter at all (Tran, Räisä, Koskela & Honkela,
"f-Differential Privacy Filters", 2026). This rule is:

- every job counts as an RDP curve ρⱼ or as an (εⱼ, δⱼ) pair, whichever the ledger chose when it
  admitted the job (a function of what was released before: an adaptively chosen parameter);
- the curves are read at **one order α fixed by the dataset's (ε, δ)** (:func:`filter_order`),
  and the dataset's δ is split in advance: the pairs may hold at most ``PAIR_DELTA_SHARE`` of it,
  the rest converts the curves;
- the spent ε is Σεⱼ while no curve was admitted, else Σρⱼ(α) + Σεⱼ + c(α, δ_c) with the
  conversion c(α, δ) = ln(1 − 1/α) − (ln δ + ln α)/(α − 1) (Balle et al., "Hypothesis Testing
  Interpretations and Renyi Differential Privacy", AISTATS 2020, Thm. 21).

Why it holds at (ε, δ). Fix neighbours x, x'. An (εⱼ, δⱼ) mechanism is a post-processing of one
that, on both sides alike, raises a flag with probability δⱼ and otherwise is εⱼ-DP (Kairouz, Oh
& Viswanath, "The Composition Theorem for Differential Privacy", ICML 2015, Thm. 2.1); outside
the flags both sides' paths are those of a *good* process, weighted alike, and the flags cost at
most Σδⱼ ≤ δ_p. In the good process let r be the likelihood ratio of the whole transcript, rₚ its
pure steps' part (rₚ ≤ e^E, E = Σεⱼ) and r_c its curves' part. Z = ∏ r_c,ᵢ^α e^{−(α−1)ρᵢ} · ∏ rₚ,ᵢ
is a supermartingale under x' (each factor's conditional mean is at most 1: RDP at α, and a
likelihood ratio), so E[Z] ≤ 1 at the filter's stopping time (Feldman & Zrnic, "Individual
Privacy Accounting via a Rényi Filter", NeurIPS 2021, prove the curves' part). Pointwise,
(r − e^ε)₊ ≤ rₚ(r_c − e^{ε−E})₊, which is 0 on a path with no curve (r_c = 1, E ≤ ε) and else at
most K·r_c^α·rₚ with K = (α−1)^{α−1}/α^α · e^{−(α−1)(ε−E)}; the rule makes K·e^{(α−1)Σρ} ≤ δ_c on
every path, so E[(r − e^ε)₊] ≤ δ_c·E[Z] ≤ δ_c. Hence P(S) ≤ e^ε P'(S) + δ_c + δ_p. Both δ shares
are fixed in advance: a split that moves with the path has no such proof.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from core.accounting import checks
from core.accounting.rdp import ORDERS

Statement = tuple[np.ndarray, float, float]
"""What a job or a total counts as: an RDP curve over :data:`ORDERS`, and a pair's ε and δ."""

#: the share of a dataset's δ that (ε, δ) statements (Liu–Talwar bounds, caps on K, profile and
#: PLD statements) may hold in all; the rest converts the dataset's curves
PAIR_DELTA_SHARE = 0.1
#: the default δ of one (ε, δ) statement (``lt``; ``ps``'s privacy-profile bound; ``rdp``'s PLD
#: statement): this share of the pairs' δ not yet held, so that jobs with defaults fit in any
#: order
STATEMENT_DELTA_SHARE = 0.5


def conversion(order: float, delta: float) -> float:
    """c(α, δ): what converting an RDP bound at order α to (ε, δ) adds (Balle et al. 2020,
    Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12)."""
    return math.log1p(-1 / order) - (math.log(delta) + math.log(order)) / (order - 1)


@functools.lru_cache(maxsize=256)
def filter_order(epsilon: float, delta: float) -> float:
    """The order the dataset's curves are read at: of :data:`ORDERS`, the one at which a
    Gaussian mechanism (curve ρ·α) spending the whole budget converts best at the curves' δ.
    A function of the dataset's (ε, δ) alone, fixed before anything is released; composed
    DP-SGD runs are close to Gaussian, so a job spending the whole budget converts almost as
    well there as at its own best order."""
    eps = checks.positive("epsilon", epsilon)
    d_c = (1 - PAIR_DELTA_SHARE) * checks.probability("delta", delta)
    costs = np.array([conversion(a, d_c) for a in ORDERS])

    def best(rho: float) -> float:
        return float(np.min(rho * ORDERS + costs))

    rho = 0.0
    if best(0.0) < eps:
        high = eps
        while best(high) < eps:
            high *= 2
        rho = brentq(lambda r: best(r) - eps, 0.0, high)
    return float(ORDERS[int(np.argmin(rho * ORDERS + costs))])


@dataclass(frozen=True)
class Filter:
    """The filter of a dataset with budget (ε, δ)."""

    epsilon: float
    delta: float

    @property
    def order(self) -> float:
        return filter_order(self.epsilon, self.delta)

    @property
    def pair_delta(self) -> float:
        """δ the (ε, δ) statements may hold in all."""
        return PAIR_DELTA_SHARE * self.delta

    @property
    def conversion_delta(self) -> float:
        """δ_c: the δ the curves are converted at."""
        return self.delta - self.pair_delta

    def statement_delta(self, held: float) -> float | None:
        """The default δ of one more (ε, δ) statement when the pairs hold ``held``:
        :data:`STATEMENT_DELTA_SHARE` of what they may still hold; None when nothing is."""
        free = self.pair_delta - held
        return STATEMENT_DELTA_SHARE * free if free > 0 else None

    def spent(self, curve: np.ndarray, pair_epsilon: float, pair_delta: float) -> float:
        """ε of a total: the curves summed (over :data:`ORDERS`; read at :attr:`order`) and the
        pairs summed. ``inf`` when the pairs hold more than :attr:`pair_delta`."""
        if pair_delta > self.pair_delta:
            return math.inf
        if not np.any(curve):
            return float(pair_epsilon)
        rho = self._at_order(curve)
        return max(0.0, rho + pair_epsilon + conversion(self.order, self.conversion_delta))

    def share(self, statement: Statement) -> float:
        """What a job's statement takes of the budget once the curves' conversion is paid
        (the conversion is paid once, by the first curve): a curve's RDP at the order, a
        pair's ε; both come out of the same room ε − c(α, δ_c)."""
        curve, pair_epsilon, _ = statement
        return (self._at_order(curve) if np.any(curve) else 0.0) + pair_epsilon

    def pick(self, options: Sequence[Statement], totals: Sequence[float]) -> int:
        """Which of a job's statements (its curve, its pairs) it counts as, ``totals`` being
        the dataset's committed ε with each: of those that fit, the one that takes least of
        the budget (:meth:`share`); where none fits, the one that leaves the total lowest.
        Judging by the total alone would count early jobs as pairs, which avoid the
        conversion each pays once but compose by basic composition: they spend the budget
        far faster later (``bench/filter_cost.py``)."""
        fits = [i for i, total in enumerate(totals) if total <= self.epsilon]
        if fits:
            return min(fits, key=lambda i: self.share(options[i]))
        return min(range(len(options)), key=lambda i: totals[i])

    def _at_order(self, curve: np.ndarray) -> float:
        return float(curve[int(np.searchsorted(ORDERS, self.order))])
