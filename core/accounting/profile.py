"""A privacy-profile bound for random stopping with truncated-negative-binomial K.

The setting is Papernot & Steinke's ("Hyperparameter Tuning with Renyi Differential Privacy",
ICLR 2022, arXiv 2110.03620): draw K from the truncated negative binomial D_{η,γ} (η ≥ 0;
η = 1 geometric, η = 0 logarithmic; K ≥ 1), run the trial Q K times, release only the best
output. Instead of Q's RDP curve, this bound uses Q's *symmetric privacy profile* δ_Q(ε) (the
largest hockey-stick divergence H_{e^ε} over neighbours, both directions), in the spirit of
Koskela, Redberg & Wang, "Privacy Profiles for Private Selection" (ICML 2024, arXiv
2402.06701). For every ε and every ε̂ ≥ 0 (docs/privacy.md, "Random stopping by privacy
profile"):

    δ_A(ε) ≤ E[K]·δ_Q(ε − (η+1)·ε̃),                                               (1)
    e^ε̃ = max{ 1 + (1−γ)·δ_Q(ε̂)/γ ,  1/(γ + (1−γ)·(1 − δ_Q(ε̂))·e^(−ε̂)) },       (2)

so A is (ε_Q(δ/E[K]) + (η+1)·min_ε̂ ε̃(ε̂), δ)-DP, ε_Q(δ′) being the trial's ε at δ′.

Proof. Order Q's outputs by score, ties broken by an independent uniform tag, so that
F(y) = P[Q(X) ≤ y] is continuous. (i) P[A(X) ≤ y] = φ(F(y)) with φ the generating function of
K, so A(X) has density φ′(F(y)) with respect to the law of Q(X). (ii) For D_{η,γ},
φ′(x) = c·(1 − (1−γ)x)^(−(η+1)), c > 0: increasing, φ′(1) = E[K]. (iii) Write
1 − (1−γ)F = γ + (1−γ)S, S = P[Q(X) > y]; Q's (ε̂, δ_Q(ε̂))-DP on {Q > y} gives
S′ ≤ min(1, e^ε̂·S + δ_Q(ε̂)); the ratio (γ + (1−γ)S′)/(γ + (1−γ)S) is largest at S = 0 or at
S = (1 − δ_Q(ε̂))e^(−ε̂), which is (2): φ′(F(y)) ≤ e^((η+1)ε̃)·φ′(F′(y)) for every y.
(iv) [φ′(F)q − e^ε·φ′(F′)q′]₊ ≤ E[K]·[q − e^(ε−(η+1)ε̃)·q′]₊ pointwise; integrate over y, and
swap X and X′ for the other direction. With δ_Q(ε₀) = 0 (pure ε₀-DP) it gives
ε₀ + (η+1)·ln(1/(γ + (1−γ)e^(−ε₀))), below Papernot–Steinke's (2+η)ε₀ (their Cor. 3).

It does not cover Poisson K (φ′'s ratio is unbounded there). Any ε̂ gives a valid bound, so an
approximate minimum is sound; a larger δ_Q makes (1) and (2) larger, so a pessimistic profile
(dp-accounting's pessimistic PLDs, Doroshenko et al., "Connect the Dots", PETS 2022) gives an
upper bound. A trial that may run one of several shapes, each drawn independently of the data,
has a profile at most the pointwise maximum of theirs (the hockey-stick divergence is jointly
convex), as :mod:`core.shapes` argues for RDP curves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from core.accounting import checks
from core.accounting.tuning import capped_epsilon, tnb_gamma

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

#: the search for the best ε̂ of (2): its first bracket, its widest, and its steps
SLACK_START, SLACK_MAX, SLACK_STEPS = 8.0, 512.0, 20
#: width of the PLDs' privacy-loss grid: pessimistic rounding, so any width is an upper bound;
#: 10⁻³ is within 10⁻³ of 10⁻⁴ on the reference numbers' ε, at a fifth of the time
DISCRETIZATION = 1e-3


class TrialProfile(Protocol):
    """A trial's symmetric privacy profile: δ_Q(ε) for ε ≥ 0, and its inverse ε_Q(δ)."""

    def delta(self, epsilon: float) -> float: ...

    def epsilon(self, delta: float) -> float: ...


class PldProfile:
    """The pointwise maximum of several trials' privacy profiles, each a dp-accounting PLD
    (its ``get_delta_for_epsilon`` is already the maximum over add and remove)."""

    def __init__(self, plds: Sequence[PrivacyLossDistribution]) -> None:
        if not plds:
            raise ValueError("a profile needs at least one privacy loss distribution")
        self.plds = tuple(plds)

    def delta(self, epsilon: float) -> float:
        """At one ε (dp-accounting's vectorized path loops in Python over the losses)."""
        return min(1.0, max(float(p.get_delta_for_epsilon(float(epsilon))) for p in self.plds))

    def epsilon(self, delta: float) -> float:
        return max(float(p.get_epsilon_for_delta(delta)) for p in self.plds)


@functools.lru_cache(maxsize=8)
def trial_pld(
    sample_rate: float, noise_multiplier: float, steps: int, validation_noise: float | None
) -> PrivacyLossDistribution:
    """Pessimistic PLD (add/remove-one) of one trial: T Poisson-subsampled Gaussian steps
    (q, σ), composed with the private validation score's Gaussian when there is one.
    Memoized, a few only (one is up to a few MB): a job's shapes share them."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    step = pld_lib.from_gaussian_mechanism(
        checks.positive("noise_multiplier", noise_multiplier),
        sampling_prob=float(checks.sample_rate(sample_rate)),
        value_discretization_interval=DISCRETIZATION,
        pessimistic_estimate=True,
        use_connect_dots=True,
    )
    pld = step.self_compose(checks.count("steps", steps))
    if validation_noise is not None:
        score = pld_lib.from_gaussian_mechanism(
            checks.positive("validation_noise", validation_noise),
            value_discretization_interval=DISCRETIZATION,
            pessimistic_estimate=True,
            use_connect_dots=True,
        )
        pld = pld.compose(score)
    return pld


#: below this y = η·ln(1/γ), E[K] is taken from its limit at η → 0 (see :func:`tnb_mean`)
TINY_ETA_LOG = 1e-9


def tnb_mean(gamma: float, eta: float) -> float:
    """E[K] = φ′(1) of D_{η,γ} (Papernot–Steinke Def. 1): η(1−γ)/(γ(1−γ^η)), or
    (1/γ − 1)/ln(1/γ) for η = 0; 1 at γ = 1 (K = 1 always).

    With y = η·ln(1/γ), η/(1 − γ^η) = (y/(1 − e^(−y)))/ln(1/γ), and y/(1 − e^(−y)) lies in
    [1, 1 + y]. Where y < ``TINY_ETA_LOG`` (η = 0, or so small that 1 − γ^η rounds to 0 — a
    subnormal η) the upper end (1 + y) is taken: E[K] rounded up, never a division by 0."""
    if gamma >= 1:
        return 1.0
    y = eta * math.log(1 / gamma)
    if y < TINY_ETA_LOG:
        return (1 - gamma) * (1 + y) / (gamma * math.log(1 / gamma))
    return eta * (1 - gamma) / (gamma * -math.expm1(-y))


def stopping_slack(profile: TrialProfile, gamma: float) -> float:
    """min over ε̂ ≥ 0 of ε̃ in (2): how far a change of the data can move the density of the
    best of K, per unit of η + 1.

    The first term of (2) does not increase in ε̂, the second does not decrease (its
    (1 − δ_Q(ε̂))·e^(−ε̂) does not increase, as 1 − δ_Q(ε) ≥ −δ_Q′(ε) for every hockey-stick
    curve), so the minimum is where they cross: found by bisection on their difference, the
    bracket widened until it holds the crossing. Every ε̂ tried gives a valid bound; the least
    is returned."""

    best = math.inf

    def crossed(e: float) -> bool:
        """Whether the second term is the larger at ε̂ = e (not where δ_Q = 1: both are 1/γ)."""
        nonlocal best
        d = max(0.0, min(1.0, profile.delta(e)))
        first = 1 + (1 - gamma) * d / gamma
        second = 1 / (gamma + (1 - gamma) * (1 - d) * math.exp(-e))
        best = min(best, max(first, second))
        return d < 1 and first <= second

    lo, hi = 0.0, SLACK_START
    while not crossed(hi) and hi < SLACK_MAX:
        lo, hi = hi, 2 * hi
    for _ in range(SLACK_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if crossed(mid) else (mid, hi)
    return math.log(best)


def _distribution(mean: float, eta: float) -> tuple[float, float]:
    """γ of D_{η,γ} with this mean (dp-accounting's conservative, smaller end) and the mean
    E[K] of the distribution K is then drawn from."""
    m = checks.at_least("mean", mean, 1.0)
    gamma = tnb_gamma(m, checks.at_least("eta", eta, 0.0))
    return gamma, tnb_mean(gamma, eta)


def selection_delta(profile: TrialProfile, epsilon: float, mean: float, eta: float) -> float:
    """δ at ε of the best of K ~ D_{η,γ} runs of the trial, uncapped: (1), at most 1. Where
    ε < (η+1)·ε̃ the bound says nothing (δ = 1)."""
    gamma, expected = _distribution(mean, eta)
    shifted = epsilon - (eta + 1) * stopping_slack(profile, gamma)
    if shifted < 0:
        return 1.0
    return min(1.0, expected * profile.delta(shifted))


def selection_epsilon(
    profile: TrialProfile, delta: float, mean: float, eta: float, tail: float = 0.0
) -> float:
    """ε at δ of the best of K ~ D_{η,γ} runs of the trial: (η+1)·ε̃ + ε_Q(δ′/E[K]), where a
    cap on K with t = P[K > cap] leaves δ′ = δ − (1 + e^ε)·t (:func:`capped_epsilon`); ``inf``
    when no ε is left."""
    d = checks.probability("delta", delta)
    gamma, expected = _distribution(mean, eta)
    slack = (eta + 1) * stopping_slack(profile, gamma)

    def epsilon_at(delta_left: float) -> float:
        return slack + profile.epsilon(delta_left / expected)

    return capped_epsilon(epsilon_at, d, tail) if tail > 0 else epsilon_at(d)


#: one trial's mechanism for :func:`trial_pld`: (q, σ, T, validation noise)
Trial = tuple[float, float, int, float | None]


@functools.lru_cache(maxsize=256)
def profile_epsilon(
    trials: tuple[Trial, ...],
    delta: float,
    mean: float,
    eta: float,
    tail: float = 0.0,
) -> float:
    """:func:`selection_epsilon` of a trial that may run any one of ``trials`` (each
    (q, σ, T, validation noise)), from their pessimistic PLDs (:func:`trial_pld`). Memoized:
    a plan states, charges and reports the same job's bound."""
    profile = PldProfile([trial_pld(*trial) for trial in trials])
    return selection_epsilon(profile, delta, mean, eta, tail)


@functools.lru_cache(maxsize=16)
def _runs_pld(trial: Trial, count: int) -> PrivacyLossDistribution:
    """The ``count``-fold self-composition of one trial's PLD. Memoized: calibrating a job's
    last runs composes them with the same earlier runs again and again."""
    pld = trial_pld(*trial)
    return pld if count == 1 else pld.self_compose(checks.count("count", count))


@functools.lru_cache(maxsize=256)
def composed_epsilon(runs: tuple[tuple[Trial, int], ...], delta: float) -> float:
    """ε at δ of runs composed: each (q, σ, T, validation noise) run ``count`` times, the
    composition of their pessimistic PLDs (:func:`trial_pld`), an upper bound on the
    composition's privacy profile (a fixed mechanism per run, whatever earlier runs released:
    adaptive composition). Memoized: a plan states, charges and reports the same job's bound,
    and calibration revisits its σs."""
    if not runs:
        raise ValueError("a composition needs at least one run")
    first, *rest = (_runs_pld(trial, count) for trial, count in runs)
    composed = functools.reduce(lambda a, b: a.compose(b), rest, first)
    return float(composed.get_epsilon_for_delta(checks.probability("delta", delta)))
