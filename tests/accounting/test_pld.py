"""Fixed-K jobs stated by PLD (``Rdp.pld_delta``), checked against independent computations:
the analytic Gaussian mechanism (Balle & Wang, "Improving the Gaussian Mechanism for
Differential Privacy", ICML 2018), whose K-fold composition is the Gaussian of σ/√K, and the
hockey-stick divergence of one Poisson-subsampled Gaussian step by quadrature. A pessimistic
PLD is an upper bound: never below the exact ε, and here within its discretisation of it."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import integrate, optimize
from scipy.stats import norm

from core.accounting import (
    PapernotSteinke,
    Rdp,
    TrialMechanism,
    calibrate_noise,
    epsilon_from_rdp,
    rdp_curve,
)
from core.accounting.profile import DISCRETIZATION

#: how far above the exact ε a pessimistic PLD of this grid may land (a few grid steps: the
#: rounding of each composed step adds up, and the connect-the-dots envelope adds a little)
SLACK = 5 * DISCRETIZATION


def gaussian_delta(epsilon: float, sigma: float) -> float:
    """δ(ε) of the Gaussian mechanism of sensitivity 1 (Balle & Wang 2018, Thm. 8)."""
    a = 1 / (2 * sigma)
    b = epsilon * sigma
    return float(norm.cdf(a - b) - math.exp(epsilon) * norm.cdf(-a - b))


def solve(delta_of: Callable[[float], float], delta: float) -> float:
    """The ε at which a decreasing δ(ε) reaches ``delta``."""
    return float(optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 200.0, xtol=1e-12))


def pld_epsilon(
    q: float, sigma: float, steps: int, trials: int, delta: float, noise: float | None = None
) -> float:
    trial = TrialMechanism(
        sample_rate=q, noise_multiplier=sigma, steps=steps, validation_noise=noise
    )
    return Rdp(trials=trials, pld_delta=delta).pld_epsilon(delta, [trial])


@pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-7])
def test_one_gaussian_is_the_analytic_gaussian(sigma: float, delta: float) -> None:
    exact = solve(lambda e: gaussian_delta(e, sigma), delta)
    got = pld_epsilon(1.0, sigma, 1, 1, delta)
    assert exact - 1e-9 <= got <= exact + SLACK


@pytest.mark.parametrize(
    ("sigma", "steps", "trials"), [(2.0, 1, 4), (4.0, 1, 16), (3.0, 5, 3), (10.0, 20, 5)]
)
def test_k_fold_composition_is_the_gaussian_of_sigma_over_root_k(
    sigma: float, steps: int, trials: int
) -> None:
    """T steps without sampling, K trials: T·K Gaussians, one Gaussian of σ/√(T·K)."""
    delta = 1e-5
    composed = sigma / math.sqrt(steps * trials)
    exact = solve(lambda e: gaussian_delta(e, composed), delta)
    got = pld_epsilon(1.0, sigma, steps, trials, delta)
    assert exact - 1e-9 <= got <= exact + SLACK * max(1, steps * trials) ** 0.5


@pytest.mark.parametrize(("sigma", "noise"), [(1.0, 2.0), (3.0, 1.5)])
def test_the_validation_score_composes_as_a_gaussian(sigma: float, noise: float) -> None:
    """One step without sampling and the score's Gaussian: the Gaussian of (σ⁻² + σ_v⁻²)^(−½)."""
    delta = 1e-5
    composed = (sigma**-2 + noise**-2) ** -0.5
    exact = solve(lambda e: gaussian_delta(e, composed), delta)
    got = pld_epsilon(1.0, sigma, 1, 1, delta, noise)
    assert exact - 1e-9 <= got <= exact + 2 * SLACK


def subsampled_delta(epsilon: float, q: float, sigma: float) -> float:
    """δ(ε) of one Poisson-subsampled Gaussian step by quadrature: the larger hockey-stick
    divergence of P = (1 − q)·N(0, σ²) + q·N(1, σ²) and Q = N(0, σ²), both directions. The
    ratio P/Q = 1 − q + q·exp((2x − 1)/(2σ²)) grows with x, so each integrand is positive on
    one side of the point where the ratio is e^ε (remove) or e^(−ε) (add): each is integrated
    there, where it is smooth."""

    def p(x: float) -> float:
        return float((1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, 1, sigma))

    def q_(x: float) -> float:
        return float(norm.pdf(x, 0, sigma))

    def crossing(ratio: float) -> float:
        return sigma**2 * math.log((ratio - 1 + q) / q) + 0.5

    w = math.exp(epsilon)
    options = {"epsabs": 0.0, "epsrel": 1e-12, "limit": 200}
    remove = integrate.quad(lambda x: p(x) - w * q_(x), crossing(w), math.inf, **options)[0]
    add = 0.0
    if 1 / w > 1 - q:
        add = integrate.quad(lambda x: q_(x) - w * p(x), -math.inf, crossing(1 / w), **options)[0]
    return max(remove, add)


@pytest.mark.parametrize(("q", "sigma"), [(0.01, 0.8), (0.1, 1.0), (0.3, 2.0), (0.5, 0.7)])
def test_one_subsampled_step_is_never_below_the_hockey_stick(q: float, sigma: float) -> None:
    delta = 1e-5
    exact = solve(lambda e: subsampled_delta(e, q, sigma), delta)
    got = pld_epsilon(q, sigma, 1, 1, delta)
    assert exact - 1e-9 <= got <= exact + SLACK


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "trials"), [(0.05, 1.0, 100, 4), (0.2, 3.0, 50, 2)]
)
def test_the_job_is_stated_by_the_smaller_bound(
    q: float, sigma: float, steps: int, trials: int
) -> None:
    """ε = min(RDP, PLD); the charge is today's curve with the PLD statement as its second
    route; without ``pld_delta``, or with runs the count does not divide, RDP alone."""
    delta = 1e-5
    trial = TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps)
    curve = rdp_curve(q, sigma, steps)
    method = Rdp(trials=trials, pld_delta=delta)
    by_rdp = epsilon_from_rdp(trials * curve, delta)[0]
    by_pld = method.pld_epsilon(delta, [trial])
    assert by_pld < by_rdp  # PLD is the tighter one on DP-SGD
    assert method.epsilon(curve, delta, [trial]) == by_pld
    assert method.bound(curve, delta, [trial]) == "pld"
    charge = method.charge(curve, delta, 10.0, [trial])
    assert charge.pld == (by_pld, delta) and charge.eps_delta is None
    assert np.array_equal(charge.rdp, trials * curve)
    plain = Rdp(trials=trials)
    assert plain.epsilon(curve, delta, [trial]) == by_rdp
    assert plain.bound(curve, delta, [trial]) == "rdp"
    assert plain.charge(curve, delta, 10.0, [trial]).pld is None
    other = TrialMechanism(sample_rate=q, noise_multiplier=sigma * 2, steps=steps)
    odd = Rdp(trials=trials + 1, pld_delta=delta)  # two runs do not divide an odd count
    assert odd.pld_epsilon(delta, [trial, other]) == math.inf


def test_the_statement_is_at_most_the_jobs_delta() -> None:
    """A ``pld_delta`` above the job's δ is stated at the job's δ."""
    trial = TrialMechanism(sample_rate=0.1, noise_multiplier=2.0, steps=50)
    at_job = Rdp(trials=2, pld_delta=1e-6).pld_epsilon(1e-6, [trial])
    assert Rdp(trials=2, pld_delta=1e-3).pld_epsilon(1e-6, [trial]) == at_job


def test_the_issues_digits_example() -> None:
    """cnn on digits as the bench splits it (1797 rows, 20 % test: N = 1438), B = 256, 20
    epochs (T = 112), one trial, ε = 2 at δ = 1e-5: σ 4.25 by RDP, 3.94 by PLD at δ."""
    q, steps, delta = 256 / 1438, 112, 1e-5
    assert calibrate_noise(q, steps, 2.0, delta, Rdp(trials=1)) == pytest.approx(4.25, abs=0.01)
    by_pld = calibrate_noise(q, steps, 2.0, delta, Rdp(trials=1, pld_delta=delta))
    assert by_pld == pytest.approx(3.94, abs=0.01)


@pytest.mark.parametrize("sigma", [0.7, 2.0, 30.0])
def test_a_ps_charge_carries_its_profile_bound_as_the_second_route(sigma: float) -> None:
    """Route A is the ps charge as before (the winning bound); the profile pair rides along as
    route B wherever it is finite, so the ledger can take it even where RDP states the job."""
    q, steps, delta = 0.01, 300, 1e-5
    method = PapernotSteinke(mean=10.0, eta=1.0, max_trials=2000, profile_delta=delta / 10)
    trial = TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps)
    curve = rdp_curve(q, sigma, steps)
    charge = method.charge(curve, delta, 10.0, [trial])
    profile = method.profile_epsilon(delta, [trial])
    assert charge.pld == (profile, delta / 10)
    if method.bound(curve, delta, [trial]) == "profile":
        assert charge.eps_delta == charge.pld and charge.rdp is None
    else:
        today = method.model_copy(update={"profile_delta": None}).charge(curve, delta, 10.0)
        assert charge.eps_delta == today.eps_delta and np.array_equal(charge.rdp, today.rdp)


@pytest.mark.parametrize(
    ("sigmas", "trials"), [((1.0, 2.0), 4), ((0.9, 0.9, 3.0), 3), ((2.0, 5.0, 1.5), 6)]
)
@pytest.mark.parametrize("delta", [1e-3, 1e-6])
def test_a_multiset_of_runs_is_the_analytic_gaussian_of_their_composition(
    sigmas: tuple[float, ...], trials: int, delta: float
) -> None:
    """Runs at several σs (a scaling job's levels and final run): each listed mechanism runs
    trials/len times, and Gaussians of σᵢ composed are the Gaussian of (Σ 1/σᵢ²)^(-1/2)."""
    runs = [TrialMechanism(sample_rate=1.0, noise_multiplier=s, steps=1) for s in sigmas]
    per = trials // len(sigmas)
    composed = sum(per / s**2 for s in sigmas) ** -0.5
    exact = solve(lambda e: gaussian_delta(e, composed), delta)
    got = Rdp(trials=trials, pld_delta=delta).pld_epsilon(delta, runs)
    assert exact <= got <= exact + SLACK
