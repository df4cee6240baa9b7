"""Rényi DP of DP-SGD and its conversion to (ε, δ).

Everything here works on RDP *curves*: numpy arrays of RDP values ε(α) over the fixed order
grid :data:`ORDERS`. Curves compose by addition (Mironov 2017, Prop. 1), which is what lets
the ledger store one curve per charge and recompute a dataset's total exactly.

Order grid. ``ORDERS`` is dp-accounting's default grid: α = 1.1, 1.2, …, 10.9 (step 0.1),
11, 12, …, 63, and 128, 256, 512, 1024 (156 orders). It covers the optimum of DP-SGD in every
practical regime (ε between about 0.05 and 100 at δ ≥ 1e-12). At fractional orders dp-accounting
0.6 sums |binom(α, i)|, an over-estimate of the Poisson-subsampled Gaussian's RDP: within 2% of
numerical integration from α ≈ 3.7 on, looser below α ≈ 3 (tests/accounting/test_rdp.py). It is
always an upper bound, so the ε we charge is never below the truth.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

from core.accounting import checks
from core.accounting.library import dp_event, rdp_lib

ORDERS: np.ndarray = np.array(rdp_lib.DEFAULT_RDP_ORDERS, dtype=np.float64)
ORDERS.setflags(write=False)


class _QuietNonConvergence(logging.Filter):
    """dp-accounting logs a warning whenever its fractional-order series does not converge
    within 1000 terms; it then sets that order's RDP to +inf, which only drops the order (a
    safe outcome). Trials log thousands of such lines, so they are filtered out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietNonConvergence())


def _accountant_curve(event: dp_event.DpEvent) -> np.ndarray:
    return np.asarray(rdp_lib.RdpAccountant(orders=ORDERS).compose(event).rdp, dtype=np.float64)


def rdp_curve(sample_rate: float, noise_multiplier: float, steps: int) -> np.ndarray:
    """RDP over :data:`ORDERS` of ``steps`` rounds of the Poisson-subsampled Gaussian
    mechanism with rate q and noise multiplier σ (noise std / L2 sensitivity).

    Computed by dp-accounting (Mironov, Talwar, Zhang 2019, "Rényi DP of the Sampled Gaussian
    Mechanism", §3.3), composed over T steps by addition. Where dp-accounting's fractional-order
    series does not converge it returns +inf; we cap every order at the unsampled Gaussian's
    α/(2σ²) instead, a valid bound because the subsampled mechanism's output is a mixture of
    Gaussians and the Rényi divergence is quasi-convex (van Erven & Harremoës 2014, Thm. 13).
    The curve stays finite, so ledger arithmetic (reserved − charged) never meets inf − inf.
    For q = 1 this is exactly the Gaussian mechanism, T·α/(2σ²).
    """
    q = checks.sample_rate(sample_rate)
    sigma = checks.positive("noise_multiplier", noise_multiplier)
    t = checks.count("steps", steps)
    return np.asarray(t * _step_curve(float(q), float(sigma)))


@functools.lru_cache(maxsize=256)
def _step_curve(q: float, sigma: float) -> np.ndarray:
    """One step's curve, read-only and memoized: dp-accounting's series at 156 orders take
    tens of milliseconds, which each trial would pay again as it ends (for its ε), though a
    job's trials of one shape share q and σ."""
    step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    curve: np.ndarray = np.minimum(_accountant_curve(step), gaussian_rdp(sigma))
    curve.setflags(write=False)
    return curve


def gaussian_rdp(noise_multiplier: float) -> np.ndarray:
    """RDP α/(2σ²) of one Gaussian release with sensitivity 1 and noise std σ (Mironov 2017,
    Prop. 7) — e.g. a private validation score, docs/design.md, invariant 5."""
    sigma = checks.positive("noise_multiplier", noise_multiplier)
    return _accountant_curve(dp_event.GaussianDpEvent(sigma))


def compose(*curves: np.ndarray) -> np.ndarray:
    """Adaptive composition of RDP mechanisms: the curves add order by order."""
    total = np.zeros_like(ORDERS)
    for curve in curves:
        curve = np.asarray(curve, dtype=np.float64)
        if curve.shape != ORDERS.shape:
            raise ValueError(f"an RDP curve must have {ORDERS.size} orders, got {curve.shape}")
        total = total + curve
    return total


def epsilon_from_rdp(rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """Smallest ε over the grid at which a mechanism with this RDP curve is (ε, δ)-DP, and the
    order attaining it.

    Uses the conversion ε = r + ln(1 − 1/α) − (ln δ + ln α)/(α − 1) (Balle et al. 2020,
    Thm. 21; Canonne–Kamath–Steinke 2020, Prop. 12), tighter than Mironov's r − ln δ/(α − 1),
    as implemented by dp-accounting (which also applies the KL bound δ ≥ √(1 − e^(−r))).
    """
    d = checks.probability("delta", delta)
    rdp = np.asarray(rdp, dtype=np.float64)
    if rdp.shape != ORDERS.shape:
        raise ValueError(f"an RDP curve must have {ORDERS.size} orders, got {rdp.shape}")
    if np.isnan(rdp).any():
        raise ValueError("rdp must not contain NaN")
    eps, order = rdp_lib.compute_epsilon(ORDERS, rdp, d)
    return float(eps), float(order)


def dpsgd_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """ε at δ of one DP-SGD run: T steps of the Poisson-subsampled Gaussian (q, σ)."""
    return epsilon_from_rdp(rdp_curve(sample_rate, noise_multiplier, steps), delta)[0]


def split_noise(noise_multiplier: float, histogram_noise: float) -> float:
    """Noise multiplier σ_T left for the gradient when a DC-SGD step also releases a noisy
    norm histogram with noise σ_H.

    Paper 001 (DC-SGD), Theorem 2: releasing the gradient with σ_T and the histogram (both of
    sensitivity 1 relative to their own scale) with σ_H composes to the same RDP as one
    Gaussian with σ when σ⁻² = σ_T⁻² + σ_H⁻², i.e. σ_T = (σ⁻² − σ_H⁻²)^(−1/2). The same split
    accounts for Andrew et al.'s noisy unclipped count (with 2σ_b in place of σ_H).
    """
    sigma = checks.positive("noise_multiplier", noise_multiplier)
    sigma_h = checks.positive("histogram_noise", histogram_noise)
    if sigma_h <= sigma:
        raise ValueError(
            f"histogram_noise (σ_H = {sigma_h}) must exceed noise_multiplier (σ = {sigma}): "
            "the histogram alone would use the whole privacy budget of the step"
        )
    return 1.0 / math.sqrt(sigma**-2 - sigma_h**-2)
