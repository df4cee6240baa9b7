"""The privacy-profile bound for random stopping (``core.accounting.profile``): its closed forms,
the reference numbers, monotonicity, never charging above Papernot–Steinke's RDP bound, and an
exact falsification on small discrete mechanisms whose best-of-K law is enumerated."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import norm

from core.accounting import (
    PapernotSteinke,
    TrialMechanism,
    calibrate_noise,
    cap_delta,
    rdp_curve,
    trials_tail,
    tuning_epsilon,
)
from core.accounting.profile import (
    PldProfile,
    profile_epsilon,
    selection_delta,
    selection_epsilon,
    stopping_slack,
    tnb_mean,
    trial_pld,
)
from core.accounting.tuning import ETA_MIN, ps_epsilon, tnb_gamma
from core.spec import JobSpec

DELTA = 1e-5


@dataclass(frozen=True)
class StepProfile:
    """δ_Q = 1 below ε₀ and 0 from it: (2) at ε̂ = ε₀ is the pure-DP closed form, and every
    other ε̂ gives more."""

    eps0: float

    def delta(self, epsilon: float) -> float:
        return 0.0 if epsilon >= self.eps0 else 1.0

    def epsilon(self, delta: float) -> float:
        return self.eps0


@dataclass(frozen=True)
class DiscreteProfile:
    """The exact symmetric profile of a pair of distributions on ordered outcomes."""

    p: np.ndarray
    p2: np.ndarray

    def delta(self, epsilon: float) -> float:
        e = math.exp(epsilon)
        return float(
            max(
                np.maximum(self.p - e * self.p2, 0).sum(), np.maximum(self.p2 - e * self.p, 0).sum()
            )
        )

    def epsilon(self, delta: float) -> float:
        raise NotImplementedError


def pure_dp_closed_form(eps0: float, mean: float, eta: float) -> float:
    gamma = tnb_gamma(mean, eta)
    return eps0 + (eta + 1) * math.log(1 / (gamma + (1 - gamma) * math.exp(-eps0)))


@pytest.mark.parametrize("eps0", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.0, 2.0, 10.0, 100.0])
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_pure_dp_closed_form_and_papernot_steinke_corollary_3(
    eps0: float, mean: float, eta: float
) -> None:
    """A pure ε₀-DP trial: ε₀ + (η+1)·ln(1/(γ + (1−γ)e^(−ε₀))), at most PS's (2+η)ε₀ (and ε₀
    itself when K = 1 always)."""
    got = selection_epsilon(StepProfile(eps0), DELTA, mean, eta)
    assert got == pytest.approx(pure_dp_closed_form(eps0, mean, eta), rel=1e-6, abs=1e-9)
    assert got <= (2 + eta) * eps0 + 1e-9
    if mean == 1.0:
        assert got == pytest.approx(eps0)


def test_randomized_response_is_at_most_its_pure_dp_closed_form() -> None:
    """Randomized response is ε₀-DP; its full profile only helps."""
    for eps0 in (0.5, 1.0, 2.0):
        e = math.exp(eps0)
        rr = DiscreteProfile(np.array([e, 1]) / (1 + e), np.array([1, e]) / (1 + e))
        gamma = tnb_gamma(10.0, 1.0)
        closed = pure_dp_closed_form(eps0, 10.0, 1.0) - eps0
        assert 2 * stopping_slack(rr, gamma) <= closed + 1e-9


def gaussian_delta(sigma: float, eps: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm. 8)."""
    return float(
        norm.cdf(1 / (2 * sigma) - eps * sigma)
        - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)
    )


@dataclass(frozen=True)
class GaussianProfile:
    sigma: float

    def delta(self, epsilon: float) -> float:
        return gaussian_delta(self.sigma, epsilon)

    def epsilon(self, delta: float) -> float:
        from scipy.optimize import brentq

        return float(brentq(lambda e: gaussian_delta(self.sigma, e) - delta, 0, 200, xtol=1e-12))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_the_gaussian_trial_against_its_exact_profile(sigma: float) -> None:
    """One unsampled Gaussian release (q = 1, T = 1): the pessimistic PLD's profile is above
    the exact one and close to it, and so is the job's ε."""
    pld = PldProfile([trial_pld(1.0, sigma, 1, None)])
    for eps in np.linspace(0, 6, 25):
        exact = gaussian_delta(sigma, eps)
        assert exact - 1e-12 <= pld.delta(eps) <= exact + 5e-3 * exact + 1e-9
    for eta in (0.0, 1.0):
        exact = selection_epsilon(GaussianProfile(sigma), DELTA, 10.0, eta)
        assert exact - 1e-9 <= selection_epsilon(pld, DELTA, 10.0, eta) <= exact + 5e-3


@pytest.mark.parametrize(("eta", "rdp", "profile"), [(0.0, 3.523, 2.705), (1.0, 4.103, 2.873)])
def test_reference_numbers(eta: float, rdp: float, profile: float) -> None:
    """The fact sheet's table: q = 0.01, σ = 1, T = 1000, δ = 1e-5, E[K] = 10 (computed there
    with dp-accounting's PLDs at a 10⁻⁴ grid and ε̂ on a 0.005 grid), to 10⁻³."""
    assert ps_epsilon(rdp_curve(0.01, 1.0, 1000), DELTA, 10.0, eta) == pytest.approx(rdp, abs=1e-3)
    got = profile_epsilon(((0.01, 1.0, 1000, None),), DELTA, 10.0, eta)
    assert got == pytest.approx(profile, abs=1e-3)


BASE = {"q": 0.05, "sigma": 1.5, "steps": 200, "mean": 10.0, "delta": DELTA}


@pytest.mark.parametrize(
    ("name", "values", "increasing"),
    [
        ("sigma", [0.8, 1.0, 1.5, 2.5, 4.0], False),
        ("steps", [10, 50, 200, 800], True),
        ("q", [0.005, 0.02, 0.05, 0.2], True),
        ("mean", [1.0, 2.0, 10.0, 50.0], True),
        ("delta", [1e-8, 1e-6, 1e-5, 1e-3], False),
    ],
)
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_monotone(name: str, values: list[float], increasing: bool, eta: float) -> None:
    epsilons = []
    for value in values:
        p = {**BASE, name: value}
        trial = (p["q"], p["sigma"], int(p["steps"]), None)
        epsilons.append(profile_epsilon((trial,), p["delta"], p["mean"], eta))
    steps = np.diff(epsilons) if increasing else -np.diff(epsilons)
    assert (steps > 0).all(), epsilons


def test_several_shapes_cost_their_pointwise_maximum() -> None:
    """A trial that may run either shape costs at least each alone; a shape dominated by the
    other (same q and T, more noise) adds nothing."""
    loud, quiet = (0.05, 1.0, 200, None), (0.05, 2.0, 200, None)
    other = (0.2, 3.0, 50, 5.0)
    both = profile_epsilon((loud, quiet), DELTA, 10.0, 1.0)
    assert both == profile_epsilon((loud,), DELTA, 10.0, 1.0)
    mixed = profile_epsilon((quiet, other), DELTA, 10.0, 1.0)
    assert mixed >= max(profile_epsilon((t,), DELTA, 10.0, 1.0) for t in (quiet, other))


def test_the_validation_score_costs_part_of_the_trial() -> None:
    plain = profile_epsilon(((0.05, 1.5, 200, None),), DELTA, 10.0, 1.0)
    scored = profile_epsilon(((0.05, 1.5, 200, 5.0),), DELTA, 10.0, 1.0)
    assert scored > plain


SETTINGS = [  # (q, σ, T, E[K], η, δ): where a job's RDP bound is between about 0.5 and 20
    (0.01, 1.0, 1000, 10.0, 0.0, 1e-5),
    (0.004, 0.9, 5000, 5.0, 1.0, 1e-6),
    (0.1, 2.0, 100, 30.0, 2.0, 1e-5),
    (0.02, 1.2, 300, 8.0, 1.0, 1e-7),
    (0.25, 3.0, 40, 3.0, 0.5, 1e-5),
    (0.001, 0.7, 10000, 100.0, 0.0, 1e-8),
    (0.18, 4.25, 112, 10.0, 1.0, 1e-5),
    (0.5, 6.0, 20, 2.0, 1.0, 1e-4),
]


@pytest.mark.parametrize(("q", "sigma", "steps", "mean", "eta", "delta"), SETTINGS)
def test_below_papernot_steinke_where_jobs_are_planned(
    q: float, sigma: float, steps: int, mean: float, eta: float, delta: float
) -> None:
    rdp = ps_epsilon(rdp_curve(q, sigma, steps), delta, mean, eta)
    assert 0.5 <= rdp <= 20
    assert profile_epsilon(((q, sigma, steps, None),), delta, mean, eta) < 0.9 * rdp


def tm(q: float, sigma: float, steps: int) -> TrialMechanism:
    return TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0, 6.0, 30.0])
@pytest.mark.parametrize("mean", [2.0, 100.0])
def test_the_charge_is_never_above_the_rdp_bound(sigma: float, mean: float) -> None:
    """Where the profile loses (trials far more private than planned jobs: ε below 0.1) the job is
    stated and charged by RDP, exactly today's charge; where it wins, by the profile as an
    (ε, δ) pair at ``profile_delta``."""
    q, steps, cap = 0.01, 300, 2000
    method = PapernotSteinke(mean=mean, eta=1.0, max_trials=cap, profile_delta=DELTA / 10)
    plain = PapernotSteinke(mean=mean, eta=1.0, max_trials=cap)
    trial = rdp_curve(q, sigma, steps)
    mechanisms = [tm(q, sigma, steps)]
    eps = method.epsilon(trial, DELTA, mechanisms)
    assert eps <= plain.epsilon(trial, DELTA)
    charge = method.charge(trial, DELTA, 10.0, mechanisms)
    if method.bound(trial, DELTA, mechanisms) == "rdp":
        today = plain.charge(trial, DELTA, 10.0)
        assert charge.eps_delta == today.eps_delta
        assert charge.rdp is not None and (charge.rdp == today.rdp).all()
    else:
        assert charge.rdp is None and charge.eps_delta == (eps, DELTA / 10)
        assert eps < plain.epsilon(trial, DELTA)


def test_without_mechanisms_or_profile_delta_it_is_todays_bound() -> None:
    trial = rdp_curve(0.01, 1.0, 1000)
    today = PapernotSteinke(mean=10.0, eta=1.0).epsilon(trial, DELTA)
    with_profile = PapernotSteinke(mean=10.0, eta=1.0, profile_delta=DELTA)
    assert with_profile.epsilon(trial, DELTA) == today
    assert with_profile.bound(trial, DELTA) == "rdp"
    assert with_profile.epsilon(trial, DELTA, [tm(0.01, 1.0, 1000)]) < today


def test_poisson_k_has_no_profile_bound() -> None:
    with pytest.raises(ValueError, match="profile_delta"):
        PapernotSteinke(mean=10.0, eta=None, profile_delta=DELTA)


@pytest.mark.parametrize("cap", [200, 250, 400])
def test_a_cap_is_paid_inside_the_profile_statement(cap: int) -> None:
    """With t = P[K > cap] the capped job's δ at its ε, E[K]·δ_Q(ε − (η+1)ε̃) + (1 + e^ε)·t, is
    at most δ; uncapped it costs less."""
    trial = (0.02, 1.2, 300, None)
    tail = trials_tail(10.0, 1.0, cap)
    eps = profile_epsilon((trial,), DELTA, 10.0, 1.0, tail)
    uncapped = profile_epsilon((trial,), DELTA, 10.0, 1.0)
    assert uncapped <= eps
    profile = PldProfile([trial_pld(*trial)])
    assert selection_delta(profile, eps, 10.0, 1.0) + cap_delta(tail, eps) <= DELTA * (1 + 1e-9)


def tnb_pgf(x: np.ndarray, gamma: float, eta: float) -> np.ndarray:
    """φ(x) = E[x^K] of D_{η,γ} (Papernot–Steinke Def. 1), in closed form."""
    if eta == 0:
        return np.log1p(-(1 - gamma) * x) / math.log(gamma)
    return ((1 - (1 - gamma) * x) ** -eta - 1) / (gamma**-eta - 1)


def best_of_k(p: np.ndarray, gamma: float, eta: float) -> np.ndarray:
    """The exact law of the largest of K ~ D_{η,γ} draws from p: P[A ≤ j] = φ(F(j))."""
    cdf = tnb_pgf(np.clip(np.cumsum(p), 0, 1), gamma, eta)
    return np.diff(np.concatenate([[0.0], cdf]))


def hockey_stick(a: np.ndarray, b: np.ndarray, eps: float) -> float:
    e = math.exp(eps)
    return float(max(np.maximum(a - e * b, 0).sum(), np.maximum(b - e * a, 0).sum()))


def test_exact_discrete_falsification() -> None:
    """Random neighbouring pairs on 2–6 ordered outcomes: the exact δ of the best of K (its law
    enumerated from the generating function of the K that ``draw_trials`` draws) never
    exceeds the bound (1), and the bound is not vacuous: it comes within 10 % of the truth."""
    rng = np.random.default_rng(20240607)
    worst = 0.0
    for _ in range(1500):
        m = int(rng.integers(2, 7))
        p = rng.dirichlet(np.ones(m))
        p2 = (1 - (w := rng.uniform(0.02, 0.6))) * p + w * rng.dirichlet(np.ones(m))
        mean = float(rng.choice([2.0, 5.0, 10.0, 30.0]))
        eta = float(rng.choice([0.0, 1.0, 2.0]))
        gamma = tnb_gamma(mean, eta)
        assert tnb_pgf(np.array([1.0]), gamma, eta)[0] == pytest.approx(1.0)
        a, a2 = best_of_k(p, gamma, eta), best_of_k(p2, gamma, eta)
        profile = DiscreteProfile(p, p2)
        for eps in (0.25, 0.5, 1.0, 2.0, 3.0):
            exact = hockey_stick(a, a2, eps)
            bound = selection_delta(profile, eps, mean, eta)
            assert exact <= bound * (1 + 1e-9) + 1e-12, (p, p2, mean, eta, eps)
            if 0 < bound < 1:
                worst = max(worst, exact / bound)
    assert worst > 0.9


@pytest.mark.parametrize(("mean", "eta"), [(10.0, 1.0), (5.0, 0.0), (20.0, 2.0), (1.0, 1.0)])
def test_the_mean_is_that_of_the_drawn_k(mean: float, eta: float) -> None:
    """E[K] of the bound is φ′(1) of the γ K is drawn with (dp-accounting's conservative γ):
    at least the requested mean, and equal to the sample mean of ``draw_trials``."""
    gamma = tnb_gamma(mean, eta)
    expected = tnb_mean(gamma, eta)
    assert expected == pytest.approx(mean, rel=1e-8) and expected >= mean * (1 - 1e-12)
    rng = np.random.default_rng(7)
    method = PapernotSteinke(mean=mean, eta=eta)
    draws = [method.draw_trials(rng) for _ in range(20000)]
    assert np.mean(draws) == pytest.approx(expected, rel=0.05)


def test_calibration_by_the_smaller_bound() -> None:
    """σ lands where the smaller bound costs the target; the profile allows less noise."""
    q, steps, target = 0.02, 300, 3.0
    method = PapernotSteinke(mean=8.0, eta=1.0, max_trials=200, profile_delta=DELTA)
    sigma = calibrate_noise(q, steps, target, DELTA, method)
    eps = tuning_epsilon(q, sigma, steps, DELTA, method)
    assert target * (1 - 1e-3) <= eps <= target
    today = calibrate_noise(
        q, steps, target, DELTA, method.model_copy(update={"profile_delta": None})
    )
    assert sigma < 0.85 * today


def test_the_issues_digits_example() -> None:
    """cnn on digits as the bench splits it (1797 rows, 20 % test: N = 1438), B = 256, 20
    epochs (T = 112), E[K] = 10, η = 1, ε = 4, δ = 1e-5, the planner's default cap: σ 4.25 by
    Papernot–Steinke's RDP bound, about 3.2 by the profile."""
    q, steps, cap = 256 / 1438, 112, 248
    method = PapernotSteinke(mean=10.0, eta=1.0, max_trials=cap, profile_delta=DELTA)
    today = method.model_copy(update={"profile_delta": None})
    assert calibrate_noise(q, steps, 4.0, DELTA, today) == pytest.approx(4.25, abs=0.01)
    assert calibrate_noise(q, steps, 4.0, DELTA, method) == pytest.approx(3.19, abs=0.02)


@pytest.mark.parametrize("eta", [5e-324, 1e-310, 1e-300, 1e-20, 1e-12, 1e-10, 1e-9, 1e-7])
@pytest.mark.parametrize("mean", [1.5, 2.0, 10.0])
def test_the_mean_of_a_tiny_eta_is_its_limit_rounded_up(eta, mean) -> None:
    """1 − γ^η rounds to 0 at a subnormal η (a division by zero, once a 500 on a plan): E[K]
    is then the η → 0 limit times (1 + η·ln(1/γ)), which bounds the exact value from above,
    and continues into the exact formula."""
    gamma = tnb_gamma(mean, 0.0)
    limit = (1 - gamma) / (gamma * math.log(1 / gamma))
    y = eta * math.log(1 / gamma)
    assert limit <= tnb_mean(gamma, eta) <= limit * (1 + y) * (1 + 1e-15)


@pytest.mark.parametrize("eta", [5e-324, 1e-300, 1e-9, 9.99e-7])
def test_an_eta_floats_cannot_price_is_refused_at_the_boundary(eta) -> None:
    """Below ETA_MIN the tail P[K > cap] rounded to 0 (5e-324: a cap costing no δ), so such an
    η is refused by the spec and by the method, naming the field."""
    assert trials_tail(2.0, 0.0, 5) > 0.04  # the tail of the η = 0 limit
    with pytest.raises(ValidationError, match="eta"):
        PapernotSteinke(mean=2.0, eta=eta, max_trials=5)
    body = {"dataset": 1, "model": {"name": "mlp"}}
    privacy = {"epsilon": 1.0, "accounting": "ps", "mean": 2.0, "eta": eta}
    with pytest.raises(ValidationError, match=r"privacy\.eta"):
        JobSpec.model_validate(body | {"privacy": privacy})
    assert PapernotSteinke(mean=2.0, eta=ETA_MIN, max_trials=5).tail() > 0.04
