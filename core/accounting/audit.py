"""The arithmetic of a one-run privacy audit: guesses → correct count → a lower bound on ε.

Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023): m
canaries are each included in the training data independently with probability 1/2; after one
training run the auditor scores every canary, guesses "in" for the most confident, "out" for the
least confident and abstains on the rest. If training is (ε, δ)-DP with respect to each canary,
the number W of correct guesses among r is stochastically dominated as in their Theorem 5.2
(approximate DP), with q = e^ε/(1 + e^ε) the accuracy of ε-DP randomized response:

    P[W ≥ v] ≤ P[Bin(r, q) ≥ v] + 2mδ · max_{i=1..v} P[v − i ≤ Bin(r, q) < v] / i.

The right-hand side is the p-value of the claim "(ε, δ)-DP" given v correct guesses; the audit's
lower bound is the largest ε that this p-value still rejects at the chosen confidence. We use this
δ-aware form, not their pure-DP Theorem (δ = 0), because DP-SGD is only (ε, δ)-DP: with δ = 0 a
correct build could be "refuted" by events of probability δ. The δ term grows with m, but its
max is small when v lies far in the binomial's upper tail: at δ = 10⁻⁵, m = 5000 (2mδ = 0.1)
still gives higher bounds than m = 1000 in ``bench/audit.py``.

The bound is statistically valid whatever the canaries and scores are (the theorem only needs
the inclusion bits to be independent fair coins, and the guesses fixed before they are compared
with them); how close it gets to the true ε depends on the attack and on m and r: with r guesses
all correct it cannot exceed about ln(r/3) at 95%.

Pure numpy/scipy, no torch: the torch side (canaries, the audited run) is ``workers.audit``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from core.accounting import checks

#: Largest ε the search considers: e^ε/(1 + e^ε) is 1 − 10⁻²² there, far beyond any count.
EPSILON_MAX = 50.0


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[≥ ``correct`` of ``guesses`` right] for an (ε, δ)-DP run with
    ``canaries`` coin-flip canaries (Steinke, Nasr, Jagielski 2023, Theorem 5.2)."""
    _check_counts(canaries, guesses, correct)
    q = 1 / (1 + math.exp(-checks.at_least("epsilon", epsilon, 0.0)))
    beta = float(stats.binom.sf(correct - 1, guesses, q))
    if checks.at_least("delta", delta, 0.0) == 0 or correct == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    below = stats.binom.sf(correct - i - 1, guesses, q) - beta  # P[v − i ≤ Bin < v]
    alpha = float(np.max(below / i))
    return min(beta + 2 * canaries * delta * alpha, 1.0)


def epsilon_lower_bound(
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = 0.95,
    tolerance: float = 1e-6,
) -> float:
    """The largest ε whose (ε, δ) claim :func:`p_value` rejects at ``confidence``, within
    ``tolerance``; 0 when even ε = 0 is not rejected.

    The p-value grows with ε (a weaker claim allows more correct guesses), so the rejected
    claims form an interval [0, ε̂) and bisection finds its end: with probability at least
    ``confidence`` the run is not (ε, δ)-DP for any ε below the returned value."""
    checks.probability("confidence", confidence)
    significance = 1 - confidence

    def rejected(epsilon: float) -> bool:
        return p_value(canaries, guesses, correct, epsilon, delta) <= significance

    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2 * hi
        if hi > EPSILON_MAX:
            return EPSILON_MAX
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


def correct_guesses(scores: np.ndarray, included: np.ndarray, guesses: int) -> int:
    """Guess "in" for the ⌈k/2⌉ highest scores and "out" for the ⌊k/2⌋ lowest (k =
    ``guesses``), abstain on the rest, and count the guesses that match ``included``.

    Ties are broken by a stable sort of the scores alone, so the guesses depend on nothing but
    the scores, as the theorem requires. Guessing on both tails (Steinke et al.'s k₊ and k₋)
    was the better split in our simulations of DP-SGD with the likelihood-ratio score."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included must be 1-D arrays of the same length")
    _check_counts(len(scores), guesses, 0)
    order = np.argsort(-scores, kind="stable")
    positive, negative = (guesses + 1) // 2, guesses // 2
    tail = order[len(order) - negative :] if negative else order[:0]
    return int(included[order[:positive]].sum() + (~included[tail]).sum())


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"guesses: need 0 ≤ correct ({correct}) ≤ guesses ({guesses}) ≤ canaries ({canaries})"
        )
