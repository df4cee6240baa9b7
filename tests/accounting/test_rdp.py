"""RDP of DP-SGD and its (ε, δ) conversion, checked against independent computations."""

import itertools
import math

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import integrate
from scipy.stats import norm

from core.accounting import (
    ORDERS,
    compose,
    dpsgd_epsilon,
    epsilon_from_rdp,
    gaussian_rdp,
    rdp_curve,
    split_noise,
)


def conversion_by_hand(rdp: np.ndarray, delta: float) -> float:
    """ε = min_α r + ln(1 − 1/α) − (ln δ + ln α)/(α − 1) (Balle et al. 2020, Thm. 21)."""
    a = ORDERS
    return float(np.min(rdp + np.log1p(-1 / a) - (np.log(delta) + np.log(a)) / (a - 1)))


@pytest.mark.parametrize(("sigma", "steps"), [(0.7, 1), (1.0, 50), (4.0, 1000)])
def test_full_batch_is_the_gaussian_closed_form(sigma: float, steps: int) -> None:
    assert rdp_curve(1.0, sigma, steps) == pytest.approx(steps * ORDERS / (2 * sigma**2))
    assert gaussian_rdp(sigma) == pytest.approx(ORDERS / (2 * sigma**2))


def test_conversion_matches_the_formula_by_hand() -> None:
    for sigma, steps, delta in [(1.0, 100, 1e-5), (3.0, 10, 1e-6), (0.8, 1, 1e-3)]:
        rdp = steps * ORDERS / (2 * sigma**2)
        assert epsilon_from_rdp(rdp, delta)[0] == pytest.approx(conversion_by_hand(rdp, delta))


def renyi_by_quadrature(q: float, sigma: float, alpha: float) -> float:
    """D_α((1−q)N(0,σ²) + qN(1,σ²) ‖ N(0,σ²)) by numerical integration: the direction that
    dominates for the Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019, Thm. 5)."""

    def integrand(z: float) -> float:
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
        return math.exp(norm.logpdf(z, scale=sigma) + alpha * log_ratio)

    # the integrand peaks near z = α; integrate well past it on both sides
    lo, hi = -40 * sigma, alpha + 40 * sigma
    value, _ = integrate.quad(
        integrand, lo, hi, points=[0.0, alpha], epsabs=0, epsrel=1e-12, limit=500
    )
    return math.log(value) / (alpha - 1)


@pytest.mark.parametrize(("q", "sigma"), [(0.01, 1.0), (0.1, 2.0), (0.3, 4.0)])
def test_subsampled_gaussian_against_numerical_integration(q: float, sigma: float) -> None:
    curve = rdp_curve(q, sigma, 1)
    for alpha in (2, 5, 16, 32):
        i = int(np.flatnonzero(alpha == ORDERS)[0])
        assert curve[i] == pytest.approx(renyi_by_quadrature(q, sigma, alpha), rel=1e-6)
    # fractional orders: dp-accounting's series is always an upper bound; loose below α ≈ 3
    # (it sums |binom(α, i)|), within 2% from there on
    for alpha in (1.5, 2.5, 3.7, 5.5, 8.5):
        i = int(np.argmin(np.abs(ORDERS - alpha)))
        exact = renyi_by_quadrature(q, sigma, float(ORDERS[i]))
        assert curve[i] >= exact * (1 - 1e-9)
        if alpha > 3:
            assert curve[i] <= exact * 1.02


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "delta"),
    [
        (256 / 60000, 1.1, 14040, 1e-5),  # Abadi et al.'s MNIST setting, 60 epochs
        (0.01, 1.0, 1000, 1e-5),
        (0.1, 2.0, 100, 1e-6),
        (1.0, 5.0, 10, 1e-5),
        (0.001, 1.5, 100_000, 1e-7),
    ],
)
def test_dpsgd_epsilon_matches_opacus(q: float, sigma: float, steps: int, delta: float) -> None:
    orders = list(ORDERS)
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    expected, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    assert dpsgd_epsilon(q, sigma, steps, delta) == pytest.approx(expected, rel=1e-4)


def test_small_noise_stays_an_upper_bound_of_opacus() -> None:
    """At σ < 1 the optimum sits at fractional orders, where dp-accounting's series (|binom|)
    over-estimates slightly: we may charge a hair more than Opacus, never less."""
    orders = list(ORDERS)
    for q, sigma, steps in [(0.004, 0.6, 5000), (0.02, 0.8, 300)]:
        rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
        expected, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
        ours = dpsgd_epsilon(q, sigma, steps, 1e-5)
        assert expected <= ours <= expected * 1.001


def test_monotone_in_noise_and_steps() -> None:
    eps_by_sigma = [dpsgd_epsilon(0.01, s, 500, 1e-5) for s in (0.6, 0.8, 1.0, 2.0, 8.0)]
    assert all(a > b for a, b in itertools.pairwise(eps_by_sigma))
    eps_by_steps = [dpsgd_epsilon(0.01, 1.0, t, 1e-5) for t in (1, 10, 100, 1000)]
    assert all(a < b for a, b in itertools.pairwise(eps_by_steps))


def test_orders_where_the_series_fails_are_capped_by_the_gaussian() -> None:
    """dp-accounting gives up (inf) on low fractional orders for large q; the curve is capped
    at the unsampled Gaussian there, so it is finite everywhere and still an upper bound."""
    curve = rdp_curve(0.3, 4.0, 10)
    assert np.isfinite(curve).all()
    assert curve[0] == pytest.approx(10 * 1.1 / (2 * 16))
    assert curve[0] >= 10 * renyi_by_quadrature(0.3, 4.0, 1.1)


def test_a_curve_is_the_callers_own() -> None:
    """One step's curve is memoized (each trial's ε at its end took 30–50 ms); what a caller
    gets is its own array, so writing to it changes no later curve of the same (q, σ)."""
    first = rdp_curve(0.02, 1.3, 1)
    expected = first.copy()
    first *= 0.0
    assert rdp_curve(0.02, 1.3, 1) == pytest.approx(expected)
    assert rdp_curve(0.02, 1.3, 3) == pytest.approx(3 * expected)


def test_composition_adds_curves() -> None:
    a, b = rdp_curve(0.01, 1.0, 300), rdp_curve(0.01, 1.0, 700)
    assert compose(a, b) == pytest.approx(rdp_curve(0.01, 1.0, 1000))


def test_split_noise_closed_form() -> None:
    sigma_t = split_noise(1.0, 5.0)
    assert sigma_t == pytest.approx(1 / math.sqrt(1 - 1 / 25))
    # the two Gaussians compose to exactly one Gaussian with σ (paper 001, Theorem 2)
    assert compose(gaussian_rdp(sigma_t), gaussian_rdp(5.0)) == pytest.approx(gaussian_rdp(1.0))
    with pytest.raises(ValueError, match="histogram_noise"):
        split_noise(2.0, 2.0)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0.0, 1.0, 10, 1e-5), "sample_rate"),
        ((1.5, 1.0, 10, 1e-5), "sample_rate"),
        ((float("nan"), 1.0, 10, 1e-5), "sample_rate"),
        ((0.1, 0.0, 10, 1e-5), "noise_multiplier"),
        ((0.1, -1.0, 10, 1e-5), "noise_multiplier"),
        ((0.1, float("nan"), 10, 1e-5), "noise_multiplier"),
        ((0.1, 1.0, 0, 1e-5), "steps"),
        ((0.1, 1.0, 2.5, 1e-5), "steps"),
        ((0.1, 1.0, 10, 0.0), "delta"),
        ((0.1, 1.0, 10, 1.0), "delta"),
        ((0.1, 1.0, 10, float("nan")), "delta"),
    ],
)
def test_bad_arguments_name_the_argument(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        dpsgd_epsilon(*args)
