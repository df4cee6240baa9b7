"""Privacy cost of a whole hyperparameter-tuning job.

Three ways to charge K trials that each run the same mechanism Q (one trial's RDP curve):

- ``rdp``: K fixed trials, all outputs may be released; RDP curves add (K·curve).
- ``lt``: Liu–Talwar random stopping, in the form of paper 001 (DC-SGD), Theorem 1.
- ``ps``: Papernot & Steinke (ICLR 2022, arXiv 2110.03620) RDP bounds for a random number of
  trials K, only the best output released.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.accounting import checks
from core.accounting.library import rdp_lib
from core.accounting.rdp import ORDERS, epsilon_from_rdp


@dataclass(frozen=True)
class LiuTalwarBound:
    """The numbers of paper 001, Theorem 1, for one job."""

    epsilon: float  # 3ε₁ + 3√(2δ₁): the job's ε
    delta: float  # 3√(2δ₁)·T + δ₂: equals the requested overall δ
    max_trials: int  # T = ⌈ln(1/δ₂)/γ⌉
    trial_epsilon: float  # ε₁
    trial_delta: float  # δ₁


def liu_talwar(trial_rdp: np.ndarray, delta: float, gamma: float, delta2: float) -> LiuTalwarBound:
    """Liu–Talwar random stopping as paper 001 (DC-SGD), Theorem 1 states it.

    After each trial a γ-coin decides whether to stop; at most T = ⌈ln(1/δ₂)/γ⌉ trials run.
    If each trial is (ε₁, δ₁)-DP, the job is (3ε₁ + 3√(2δ₁), 3√(2δ₁)·T + δ₂)-DP. Given the
    job's overall δ we choose δ₁ = ((δ − δ₂)/(3T))²/2 so that 3√(2δ₁)·T + δ₂ = δ exactly, and
    ε₁ = the trial's ε at δ₁. (The original Liu–Talwar statement may have √(2δ₁)·T in the δ
    term; paper 001's 3√(2δ₁)·T is the larger, hence safe, reading.)
    """
    d = checks.probability("delta", delta)
    g = checks.positive("gamma", gamma)
    if g > 1:
        raise ValueError(f"gamma must be in (0, 1], got {g}")
    d2 = checks.probability("delta2", delta2)
    if d2 >= d:
        raise ValueError(f"delta2 must be smaller than delta ({d}), got {d2}")
    max_trials = math.ceil(math.log(1 / d2) / g)
    delta1 = ((d - d2) / (3 * max_trials)) ** 2 / 2
    eps1, _ = epsilon_from_rdp(trial_rdp, delta1)
    return LiuTalwarBound(
        epsilon=3 * eps1 + 3 * math.sqrt(2 * delta1),
        delta=3 * math.sqrt(2 * delta1) * max_trials + d2,
        max_trials=max_trials,
        trial_epsilon=eps1,
        trial_delta=delta1,
    )


def _ps_shape(eta: float | None) -> float:
    return math.inf if eta is None else checks.at_least("eta", eta, 0.0)


#: the smallest positive η of D_{η,γ}: below it 1 − γ^η rounds away (to 0 at a subnormal η),
#: and with it the tail P[K > cap] that a cap is charged for; D_{η,γ} is within 10⁻⁶ of the
#: logarithmic distribution (η = 0) there anyway
ETA_MIN = 1e-6


def checked_eta(eta: float) -> float:
    """η as D_{η,γ} takes it: 0, or at least :data:`ETA_MIN` (a range check at the boundary:
    an η that floats cannot price is refused, not charged a cap's δ of 0)."""
    if 0 < eta < ETA_MIN:
        raise ValueError(f"eta: 0 (logarithmic) or at least {ETA_MIN:g}, got {eta!r}")
    return eta


def tnb_gamma(mean: float, eta: float) -> float:
    """γ of the truncated negative binomial D_{η,γ} with the given mean (Papernot–Steinke
    Def. 1; γ = 1/mean for the geometric η = 1). Bisection by dp-accounting, which returns the
    conservative (smaller-γ, heavier-tailed) end."""
    return float(rdp_lib._gamma_truncated_negative_binomial(eta, mean))


def trials_tail(mean: float, eta: float | None, max_trials: int) -> float:
    """P[K > max_trials] for the Papernot–Steinke distribution of K.

    Poisson(μ): the Poisson survival function. Truncated negative binomial with η > 0: it is a
    negative binomial NB(η, γ) conditioned on K ≥ 1, so P[K > k] = sf_NB(k)/(1 − γ^η).
    η = 0 is the logarithmic distribution with parameter 1 − γ. (SciPy's stats, imported here:
    0.3 s of every accounting process's start, and only a capped random-stopping plan needs
    it; :mod:`core.accounting.library` says why that start matters.)
    """
    from scipy import stats

    if eta is None:
        return float(stats.poisson.sf(max_trials, mean))
    gamma = tnb_gamma(mean, eta)
    if gamma >= 1:  # mean 1: the truncated distribution is K = 1 always (the formula is 0/0)
        return 0.0 if max_trials >= 1 else 1.0
    if eta == 0:
        return float(stats.logser.sf(max_trials, 1 - gamma))
    return float(stats.nbinom.sf(max_trials, eta, gamma) / -math.expm1(eta * math.log(gamma)))


def tuning_rdp(trial_rdp: np.ndarray, mean: float, eta: float | None) -> np.ndarray:
    """RDP curve of running Q a random number K of times and releasing only the best output
    (Papernot & Steinke, ICLR 2022).

    - K ~ truncated negative binomial D_{η,γ} (η ≥ 0; η = 1 geometric, η = 0 logarithmic),
      Theorem 2: ε'(λ) = ε(λ) + (1+η)(1 − 1/λ̂)ε(λ̂) + (1+η)ln(1/γ)/λ̂ + ln(E[K])/(λ − 1),
      minimised over λ̂ on the grid, then made monotone in λ.
    - K ~ Poisson(μ) (``eta=None``), Theorem 6: ε'(λ) = ε(λ) + μ·δ̂ + ln(μ)/(λ − 1) with δ̂
      the trial's δ at ε̂ = ln(1 + 1/(λ − 1)).

    Evaluated by dp-accounting's implementation of exactly these theorems
    (``RepeatAndSelectDpEvent``); its event API needs a DpEvent, while our trials are arbitrary
    RDP curves (DP-SGD plus a private validation score), so the curve-level function is used.
    """
    m = checks.at_least("mean", mean, 1.0)
    shape = _ps_shape(eta)
    trial_rdp = np.asarray(trial_rdp, dtype=np.float64)
    return np.asarray(rdp_lib._compute_rdp_repeat_and_select(ORDERS, trial_rdp, m, shape))


def cap_delta(tail: float, epsilon: float) -> float:
    """δ that a cap on K costs in an (ε, δ) statement: (1 + e^ε)·t with t = P[K > cap].

    The capped job M' is the uncapped one M except on the event K > cap, so on every dataset
    the output distributions of M' and M are within total variation distance t. If M is
    (ε, δ')-DP then for neighbours D, D' and every set S of outputs
    P[M'(D)∈S] ≤ P[M(D)∈S] + t ≤ e^ε·P[M(D')∈S] + δ' + t ≤ e^ε·(P[M'(D')∈S] + t) + δ' + t,
    so M' is (ε, δ' + (1 + e^ε)·t)-DP — the cap costs (1 + e^ε)·t, not t. The argument holds
    for any mechanism that runs M' among others (the whole transcript is still within t), at
    the ε of that mechanism's statement.
    """
    t = checks.at_least("tail", tail, 0.0)
    if t > 1:
        raise ValueError(f"tail must be a probability, got {t}")
    eps = checks.at_least("epsilon", epsilon, 0.0)
    return t + math.exp(eps + math.log(t)) if t > 0 else 0.0  # e^ε·t without overflowing e^ε


#: relative margin above the least fixed point ε = ε_rdp(δ − (1 + e^ε)·t) that ps_epsilon returns
_FIXED_POINT_SLACK = 1e-9
_FIXED_POINT_ITERATIONS = 200


def capped_epsilon(epsilon_at: Callable[[float], float], delta: float, tail: float) -> float:
    """Least ε (to a relative 10⁻⁹, from above) with ε ≥ f(ε) := ε_at(δ − (1 + e^ε)·t), or
    ``inf`` when there is none, for ``epsilon_at`` the uncapped job's ε at a δ: at such an ε
    the uncapped job is (ε, δ − (1 + e^ε)·t)-DP, hence the capped one (ε, δ)-DP
    (:func:`cap_delta`).

    f increases in ε, so the iteration ε ← f(ε)·(1 + slack) from 0 increases monotonically; it
    stops at the first ε with f(ε) ≤ ε, which lies within the slack of the least fixed point. It
    contracts fast (for RDP f' ≈ e^ε·t / ((α − 1)·(δ − (1 + e^ε)t)) ≪ 1 for the caps the
    planner picks).
    """
    if cap_delta(tail, 0.0) >= delta:
        return math.inf  # not even ε = 0 leaves δ for the uncapped job
    eps_max = math.log(delta / tail - 1) if tail > 0 else math.inf  # (1 + e^ε_max)·t = δ
    eps = 0.0
    for _ in range(_FIXED_POINT_ITERATIONS):
        if eps >= eps_max:
            return math.inf  # no δ is left for the uncapped job
        needed = epsilon_at(delta - cap_delta(tail, eps))
        if needed <= eps:
            return eps
        eps = needed * (1 + _FIXED_POINT_SLACK)
    return math.inf


def ps_epsilon(
    trial_rdp: np.ndarray,
    delta: float,
    mean: float,
    eta: float | None,
    max_trials: int | None = None,
) -> float:
    """ε at overall δ of a Papernot–Steinke job (Papernot & Steinke, "Hyperparameter Tuning
    with Renyi Differential Privacy", ICLR 2022), the RDP curve of :func:`tuning_rdp`.

    The driver never runs more than ``max_trials``; that cap costs (1 + e^ε)·P[K > cap] of δ at
    the statement's own ε (:func:`cap_delta`), so ε is the least fixed point of
    ε = ε_rdp(δ − (1 + e^ε)·P[K > cap]). Raises ``ValueError`` when the cap leaves no δ even at
    ε = 0 (2·P[K > cap] ≥ δ); returns ``inf`` when the trials are too costly for any ε.
    """
    d = checks.probability("delta", delta)
    curve = tuning_rdp(trial_rdp, mean, eta)
    if max_trials is None:
        return epsilon_from_rdp(curve, d)[0]
    tail = trials_tail(mean, eta, checks.count("max_trials", max_trials))
    if cap_delta(tail, 0.0) >= d:
        raise ValueError(
            f"max_trials is too small: P[K > max_trials] = {tail:.3g} leaves no δ: the cap costs "
            f"(1 + e^ε)·{tail:.3g} ≥ {cap_delta(tail, 0.0):.3g}, not below δ = {d:g}"
        )
    return capped_epsilon(lambda left: epsilon_from_rdp(curve, left)[0], d, tail)
