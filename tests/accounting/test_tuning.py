"""Tuning-job bounds (Liu–Talwar, Papernot–Steinke, fixed-K RDP), the ledger rule and
calibration, each against an independent computation."""

import itertools
import math

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import optimize
from scipy.stats import norm, poisson

from core.accounting import (
    ORDERS,
    PapernotSteinke,
    calibrate_noise,
    calibration,
    charges_epsilon,
    dpsgd_epsilon,
    epsilon_from_rdp,
    gaussian_rdp,
    liu_talwar,
    rdp_curve,
    trials_tail,
    tuning_epsilon,
    tuning_rdp,
)
from core.accounting.charges import trial_rdp

DELTA = 1e-5


def opacus_epsilon(rdp: np.ndarray, delta: float) -> float:
    return opacus_rdp.get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)[0]


def tnb_gamma_by_root(mean: float, eta: float) -> float:
    """γ with E[K] = η(1−γ)/(γ(1−γ^η)) (Papernot–Steinke Def. 1), by Brent's method."""

    def excess(g: float) -> float:
        if eta == 0:
            return (1 / g - 1) / math.log(1 / g) - mean
        return eta * (1 - g) / (g * (1 - g**eta)) - mean

    return optimize.brentq(excess, 1e-12, 1 - 1e-12, xtol=1e-15, rtol=1e-14)


def theorem2_by_hand(trial: np.ndarray, mean: float, eta: float) -> np.ndarray:
    """Papernot–Steinke Thm. 2, minimised over λ̂ on the grid, then monotone in λ."""
    gamma = tnb_gamma_by_root(mean, eta)
    best_hat = min(
        (1 - 1 / lh) * eh + math.log(1 / gamma) / lh for lh, eh in zip(ORDERS, trial, strict=True)
    )
    out = np.array(
        [
            e + (1 + eta) * best_hat + math.log(mean) / (lam - 1)
            for lam, e in zip(ORDERS, trial, strict=True)
        ]
    )
    return np.minimum.accumulate(out[::-1])[::-1]


@pytest.mark.parametrize(("mean", "eta"), [(10, 1.0), (5, 0.5), (20, 2.0), (8, 0.0)])
def test_truncated_negative_binomial_matches_theorem_2(mean: float, eta: float) -> None:
    trial = rdp_curve(0.01, 1.0, 500)
    assert tuning_rdp(trial, mean, eta) == pytest.approx(
        theorem2_by_hand(trial, mean, eta), rel=1e-6
    )


def gaussian_delta(sigma: float, eps: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm. 8)."""
    return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(
        -1 / (2 * sigma) - eps * sigma
    )


def test_poisson_matches_theorem_6_with_the_exact_gaussian_delta() -> None:
    """Thm. 6 needs the trial's δ̂ at ε̂ = ln(1 + 1/(λ−1)); the library bounds it through RDP,
    here it is the Gaussian mechanism's exact δ: ours must be an upper bound, and a close one
    where it matters (the ε at the job's δ)."""
    sigma, steps, mean = 2.0, 25, 10.0
    trial = rdp_curve(1.0, sigma, steps)  # = one Gaussian with σ/√T
    ours = tuning_rdp(trial, mean, None)
    exact = np.array(
        [
            e
            + mean * gaussian_delta(sigma / math.sqrt(steps), math.log1p(1 / (lam - 1)))
            + math.log(mean) / (lam - 1)
            for lam, e in zip(ORDERS, trial, strict=True)
        ]
    )
    assert np.all(ours >= exact * (1 - 1e-9))
    eps_exact = opacus_epsilon(exact, DELTA)
    assert eps_exact <= epsilon_from_rdp(ours, DELTA)[0] <= eps_exact * 1.25


def delta_from_rdp_by_hand(trial: np.ndarray, eps: float) -> float:
    """δ(ε) ≤ min_α exp((α−1)(r − ε + ln(1 − 1/α)) − ln α)/… (Canonne–Kamath–Steinke 2020,
    Prop. 12) together with the KL bound √(1 − e^(−r))."""
    a = ORDERS
    log_conv = (a - 1) * (trial - eps + np.log1p(-1 / a)) - np.log(a)
    log_conv = np.where(a > 1.01, log_conv, np.inf)
    log_kl = 0.5 * np.log1p(-np.exp(-trial))
    return float(min(1.0, np.exp(np.min(np.minimum(log_conv, log_kl)))))


def test_poisson_matches_theorem_6_with_delta_from_rdp() -> None:
    trial = rdp_curve(0.01, 1.0, 500)
    mean = 12.0
    by_hand = np.array(
        [
            e
            + mean * delta_from_rdp_by_hand(trial, math.log1p(1 / (lam - 1)))
            + math.log(mean) / (lam - 1)
            for lam, e in zip(ORDERS, trial, strict=True)
        ]
    )
    assert tuning_rdp(trial, mean, None) == pytest.approx(by_hand, rel=1e-9)


def test_geometric_gaussian_against_corollary_4() -> None:
    """Cor. 4: for ρ-zCDP Q (RDP ρλ) and K ~ D_{η,γ}, Thm. 2 minimised over a continuous λ̂
    gives ρλ + ln E[K]/(λ−1) + (1+η)(2√(ρ ln(1/γ)) − ρ). Our grid minimum sits above it, close,
    after both are made monotone in λ."""
    sigma, steps, mean, eta = 10.0, 100, 10.0, 1.0
    rho = steps / (2 * sigma**2)
    closed = (
        rho * ORDERS
        + math.log(mean) / (ORDERS - 1)
        + (1 + eta) * (2 * math.sqrt(rho * math.log(mean)) - rho)
    )
    closed = np.minimum.accumulate(closed[::-1])[::-1]
    ours = tuning_rdp(rdp_curve(1.0, sigma, steps), mean, eta)
    assert np.all(ours >= closed * (1 - 1e-9))
    assert np.all(ours <= closed * 1.02 + 1e-3)


def test_liu_talwar_arithmetic() -> None:
    sigma, steps, delta, gamma, delta2 = 3.0, 20, 1e-5, 0.1, 1e-6
    trial = rdp_curve(1.0, sigma, steps)
    bound = liu_talwar(trial, delta, gamma, delta2)
    assert bound.max_trials == 139  # ⌈ln(10⁶)/0.1⌉ = ⌈138.155⌉
    delta1 = ((delta - delta2) / (3 * 139)) ** 2 / 2
    assert bound.trial_delta == pytest.approx(delta1, rel=1e-12)
    assert bound.delta == pytest.approx(delta, rel=1e-12)
    eps1 = opacus_epsilon(steps * ORDERS / (2 * sigma**2), delta1)
    assert bound.epsilon == pytest.approx(3 * eps1 + 3 * math.sqrt(2 * delta1), rel=1e-9)
    assert tuning_epsilon(1.0, sigma, steps, delta, "lt", gamma=gamma, delta2=delta2) == (
        pytest.approx(bound.epsilon)
    )


def test_fixed_trials_compose() -> None:
    q, sigma, steps = 0.02, 1.2, 400
    eps = [tuning_epsilon(q, sigma, steps, DELTA, "rdp", trials=k) for k in (1, 2, 5, 20)]
    assert eps[0] == pytest.approx(dpsgd_epsilon(q, sigma, steps, DELTA))
    assert eps[2] == pytest.approx(opacus_epsilon(5 * rdp_curve(q, sigma, steps), DELTA), rel=1e-4)
    assert all(a < b for a, b in itertools.pairwise(eps))


def test_papernot_steinke_is_tighter_than_liu_talwar_on_dpsgd() -> None:
    q, sigma, steps = 0.01, 1.0, 1000
    lt = tuning_epsilon(q, sigma, steps, DELTA, "lt", gamma=0.1, delta2=DELTA / 10)
    ps = tuning_epsilon(q, sigma, steps, DELTA, "ps", mean=10, eta=1.0)
    single = dpsgd_epsilon(q, sigma, steps, DELTA)
    assert single < ps < lt
    assert ps < tuning_epsilon(q, sigma, steps, DELTA, "rdp", trials=10)


@pytest.mark.parametrize(("mean", "eta"), [(10.0, 1.0), (6.0, None), (7.0, 2.0), (5.0, 0.0)])
def test_trials_tail_against_the_pmf(mean: float, eta: float | None) -> None:
    cap = 30
    if eta is None:
        pmf = [math.exp(-mean) * mean**k / math.factorial(k) for k in range(cap + 1)]
    else:
        gamma = tnb_gamma_by_root(mean, eta)
        if eta == 0:
            pmf = [0.0] + [(1 - gamma) ** k / (k * math.log(1 / gamma)) for k in range(1, cap + 1)]
        else:
            pmf = [0.0] + [
                (1 - gamma) ** k
                / (gamma**-eta - 1)
                * math.prod((i + eta) / (i + 1) for i in range(k))
                for k in range(1, cap + 1)
            ]
    assert trials_tail(mean, eta, cap) == pytest.approx(1 - sum(pmf), rel=1e-5, abs=1e-15)


def assert_least_fixed_point(curve: np.ndarray, eps: float, tail: float) -> None:
    """ε is (to 10⁻⁶) the least ε with ε ≥ ε_rdp(δ − (1 + e^ε)·t): the uncapped job is
    (ε, δ − (1 + e^ε)·t)-DP, so the capped one is (ε, δ)-DP, and no smaller ε is."""
    assert eps >= epsilon_from_rdp(curve, DELTA - (1 + math.exp(eps)) * tail)[0]
    below = eps * (1 - 1e-6)
    assert below < epsilon_from_rdp(curve, DELTA - (1 + math.exp(below)) * tail)[0]


@pytest.mark.parametrize("cap", [150, 200, 400])
def test_geometric_cap_costs_one_plus_e_to_the_epsilon_times_the_tail(cap: int) -> None:
    """Capping K changes the output with probability t = P[K > cap] on both neighbours, which
    costs (1 + e^ε)·t of δ; geometric K (η = 1) has P[K > k] = (1 − 1/mean)^k."""
    mean, budget = 10.0, 8.0
    trial = rdp_curve(0.01, 1.0, 500)
    curve = tuning_rdp(trial, mean, 1.0)
    tail = (1 - 1 / mean) ** cap
    eps = tuning_epsilon(0.01, 1.0, 500, DELTA, "ps", mean=mean, eta=1.0, max_trials=cap)
    assert_least_fixed_point(curve, eps, tail)
    assert eps > epsilon_from_rdp(curve, DELTA - tail)[0]  # more than charging t alone
    charge = PapernotSteinke(mean=mean, eta=1.0, max_trials=cap).charge(trial, DELTA, budget)
    assert np.array_equal(charge.rdp, curve)
    assert charge.eps_delta[0] == 0.0
    assert charge.eps_delta[1] == pytest.approx((1 + math.exp(budget)) * tail, rel=1e-9)


def test_poisson_cap_costs_one_plus_e_to_the_epsilon_times_the_tail() -> None:
    mean, cap, budget = 10.0, 40, 20.0
    trial = rdp_curve(0.01, 1.0, 500)
    tail = poisson.sf(cap, mean)
    eps = tuning_epsilon(0.01, 1.0, 500, DELTA, "ps", mean=mean, eta=None, max_trials=cap)
    assert_least_fixed_point(tuning_rdp(trial, mean, None), eps, tail)
    charge = PapernotSteinke(mean=mean, eta=None, max_trials=cap).charge(trial, DELTA, budget)
    assert charge.eps_delta[1] == pytest.approx((1 + math.exp(budget)) * tail, rel=1e-9)


def test_a_cap_that_leaves_no_delta_is_refused() -> None:
    cap = 105  # 0.9^105 = 1.6e-5: 2t > δ, so no ε leaves any δ
    with pytest.raises(ValueError, match="max_trials is too small"):
        tuning_epsilon(0.01, 1.0, 500, DELTA, "ps", mean=10.0, eta=1.0, max_trials=cap)


def test_capped_calibration_lands_on_the_fixed_point() -> None:
    q, steps, mean, cap = 0.02, 300, 8.0, 120
    sigma = calibrate_noise(q, steps, 3.0, DELTA, "ps", mean=mean, eta=1.0, max_trials=cap)
    eps = tuning_epsilon(q, sigma, steps, DELTA, "ps", mean=mean, eta=1.0, max_trials=cap)
    assert 3.0 * (1 - 1e-3) <= eps <= 3.0
    curve = tuning_rdp(rdp_curve(q, sigma, steps), mean, 1.0)
    assert_least_fixed_point(curve, eps, (1 - 1 / mean) ** cap)


def test_dataset_rule_of_invariant_7() -> None:
    a, b = rdp_curve(0.01, 1.0, 300), rdp_curve(0.02, 2.0, 100)
    by_hand = opacus_epsilon(a + b, DELTA - 2e-6) + 0.5 + 1.25
    got = charges_epsilon([a, b], [(0.5, 1e-6), (1.25, 1e-6)], DELTA)
    assert got == pytest.approx(by_hand, rel=1e-6)
    assert charges_epsilon([], [(0.5, 1e-6)], DELTA) == 0.5
    assert charges_epsilon([], [], DELTA) == 0.0
    assert charges_epsilon([a], [(0.1, DELTA)], DELTA) == math.inf


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("single", {}),
        ("rdp", {"trials": 8}),
        ("lt", {"gamma": 0.2, "delta2": 1e-6}),
        ("ps", {"mean": 8, "eta": 1.0}),
        ("ps", {"mean": 8}),
    ],
)
def test_calibration_round_trips(method: str, params: dict) -> None:
    q, steps, target = 0.02, 300, 3.0
    charged = () if method == "single" else (method,)  # the default: one trial
    sigma = calibrate_noise(q, steps, target, DELTA, *charged, **params)
    if method == "single":
        eps = dpsgd_epsilon(q, sigma, steps, DELTA)
    else:
        eps = tuning_epsilon(q, sigma, steps, DELTA, method, **params)
    assert target * (1 - 1e-3) <= eps <= target
    assert calibrate_noise(q, steps, target / 2, DELTA, *charged, **params) > sigma


@pytest.mark.parametrize(
    ("q", "steps", "target"),
    [(0.0358, 28, 40.0), (0.02, 300, 3.0), (0.01, 3000, 1.0), (0.5, 10, 8.0), (0.004, 10_000, 2.0)],
)
def test_calibration_needs_few_rdp_curves(monkeypatch, q: float, steps: int, target: float) -> None:
    """Each cost is a subsampled-Gaussian RDP curve (~0.1 s; planning a job calibrates before
    it answers). Bisection took 20–31 of them on these cases; the Illinois steps take at most
    8 after the bracket [0.01, 2^k] is found, and still land in the window."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return trial_rdp(*args, **kwargs)

    monkeypatch.setattr(calibration, "trial_rdp", counted)
    sigma = calibrate_noise(q, steps, target, DELTA)
    bracket = 2 + max(0, math.ceil(math.log2(sigma)))  # σ = 1, its doublings, then σ = 0.01
    assert len(calls) <= bracket + 8
    assert target * (1 - 1e-3) <= dpsgd_epsilon(q, sigma, steps, DELTA) <= target


def test_calibration_falls_back_to_halving_where_the_cost_jumps() -> None:
    """A cost with a jump (no chord points at the root) and an infinite side still ends in the
    window, at a σ whose cost was computed."""
    seen: dict[float, float] = {}

    def cost(sigma: float) -> float:
        eps = math.inf if sigma < 0.05 else (10.0 if sigma < 3.7 else 1.0 / sigma)
        seen[sigma] = eps
        return eps

    sigma = calibration.solve_noise(cost, 0.27)
    assert sigma in seen
    assert 0.27 * (1 - 1e-3) <= seen[sigma] <= 0.27


def test_calibration_counts_extra_mechanisms() -> None:
    extra = gaussian_rdp(5.0)
    plain = calibrate_noise(0.02, 300, 3.0, DELTA)
    with_validation = calibrate_noise(0.02, 300, 3.0, DELTA, extra_rdp=extra)
    assert with_validation > plain
    eps = epsilon_from_rdp(rdp_curve(0.02, with_validation, 300) + extra, DELTA)[0]
    assert 3.0 * (1 - 1e-3) <= eps <= 3.0


def test_calibration_refuses_unreachable_targets() -> None:
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise(0.02, 300, 0.01, DELTA, "ps", mean=100, eta=1.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise(0.02, 300, -1.0, DELTA)


@pytest.mark.parametrize(
    ("method", "params", "name"),
    [
        ("bogus", {}, "method"),
        ("rdp", {}, "trials"),
        ("rdp", {"trials": 0}, "trials"),
        ("lt", {"delta2": 1e-6}, "gamma"),
        ("lt", {"gamma": 0.1}, "delta2"),
        ("lt", {"gamma": 0.1, "delta2": 1e-4}, "delta2"),
        ("lt", {"gamma": 1.5, "delta2": 1e-6}, "gamma"),
        ("ps", {}, "mean"),
        ("ps", {"mean": 0.5}, "mean"),
        ("ps", {"mean": 5, "eta": -1.0}, "eta"),
        ("ps", {"mean": float("nan")}, "mean"),
        ("rdp", {"trials": 3, "gamma": 0.1}, "gamma"),
    ],
)
def test_bad_job_parameters_name_the_parameter(method: str, params: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        tuning_epsilon(0.01, 1.0, 100, DELTA, method, **params)


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "validation"),
    [(0.01, 1.0, 1000, None), (0.02, 3.0, 2000, 5.0), (0.05, 1.2, 300, 20.0)],
)
@pytest.mark.parametrize(("mean", "eta"), [(10.0, 1.0), (5.0, None), (8.0, 0.0), (6.0, 0.5)])
def test_papernot_steinke_equals_dp_accountings_repeat_and_select(
    q, sigma, steps, validation, mean, eta
) -> None:
    """Our curve-level Theorems 2/6 against dp-accounting's event API on the trial as a
    DpEvent (an independent path through the library: its own trial curve and composition)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    from core.accounting import ORDERS, TrialMechanism

    trial = TrialMechanism(
        sample_rate=q, noise_multiplier=sigma, steps=steps, validation_noise=validation
    )
    event = dp_event.RepeatAndSelectDpEvent(trial.dp_event(), mean, np.inf if eta is None else eta)
    theirs = np.asarray(rdp_lib.RdpAccountant(orders=ORDERS).compose(event).rdp)
    assert np.all(np.isfinite(theirs))
    np.testing.assert_allclose(tuning_rdp(trial.rdp(), mean, eta), theirs, rtol=1e-12)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_ps_tail_at_mean_one_is_that_of_a_single_trial(eta):
    """Mean 1 means K = 1 always; the closed form is 0/0 there (it answered NaN, and a job
    with ``"mean": 1`` got an HTTP 500)."""
    for cap in (1, 5):  # exactly 0, or the tiny tail of dp-accounting's conservative γ < 1
        assert 0.0 <= trials_tail(1.0, eta, cap) < 1e-6
    assert trials_tail(1.0 + 1e-9, eta, 1) < 1e-6  # continuous from above
