"""Noise calibration: the smallest σ whose cost lands at or just below a target ε."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from core.accounting import checks
from core.accounting.charges import trial_rdp
from core.accounting.methods import SINGLE, TrialMechanism, TuningMethod, tuning_method
from core.accounting.rdp import compose, gaussian_rdp

#: calibrated ε lies in [target·(1 − RELATIVE_TOLERANCE), target]
RELATIVE_TOLERANCE = 1e-3
SIGMA_MIN, SIGMA_MAX = 1e-2, 1e4


def solve_noise(cost: Callable[[float], float], target: float) -> float:
    """Largest-cost σ with cost(σ) ≤ target, to the relative tolerance, for a cost that
    decreases in σ. The root is bracketed and then found by regula falsi in (log σ, log ε)
    with the Illinois modification (Dowell & Jarratt, "A modified regula falsi method for
    computing the root of an equation", BIT 1971): ε is smooth in σ, so this needs a handful
    of evaluations where bisection needed ~30 (each one an RDP curve: ~0.1 s). The aim is the
    middle of the accepted window; a step that would leave the bracket, or a side with no
    finite ε, falls back to halving it in log σ. Whatever the steps, only a σ whose ε was
    computed and found in [target·(1 − tolerance), target] is returned."""
    lo, hi = SIGMA_MIN, 1.0
    cost_hi = cost(hi)
    while cost_hi > target:
        lo, hi = hi, hi * 2
        if hi > SIGMA_MAX:
            raise ValueError(
                f"target_epsilon {target} is too small: even noise_multiplier {SIGMA_MAX:g} "
                "costs more"
            )
        cost_hi = cost(hi)
    cost_lo = cost(lo)
    if cost_lo <= target:
        return lo  # the target is looser than any noise we would ever recommend
    floor = target * (1 - RELATIVE_TOLERANCE)
    aim = math.log(target * (1 - RELATIVE_TOLERANCE / 2))
    a, b = math.log(lo), math.log(hi)  # log σ: ε too large at a, in or below the window at b
    fa, fb = _gap(cost_lo, aim), _gap(cost_hi, aim)
    kept = 0  # > 0: a was kept by the last steps; < 0: b was
    for _ in range(200):
        if cost_hi >= floor:
            break
        x = _false_position(a, fa, b, fb)
        eps = cost(math.exp(x))
        if eps > target:
            a, fa, kept = x, _gap(eps, aim), min(kept, 0) - 1
            if kept < -1:
                fb /= 2
        else:
            b, fb, hi, cost_hi, kept = x, _gap(eps, aim), math.exp(x), eps, max(kept, 0) + 1
            if kept > 1:
                fa /= 2
    return hi


def _gap(eps: float, aim: float) -> float:
    """log ε − aim: positive where σ is too small (infinite where ε is)."""
    return math.log(eps) - aim if eps > 0 else -math.inf


def _false_position(a: float, fa: float, b: float, fb: float) -> float:
    """Where the chord from (a, fa) to (b, fb) crosses zero; the midpoint when it cannot be
    drawn or would leave the open interval (a, b) by more than rounding."""
    mid = (a + b) / 2
    if not (math.isfinite(fa) and math.isfinite(fb)) or fa <= fb:
        return mid
    x = b - fb * (b - a) / (fb - fa)
    width = b - a
    return x if a + width * 1e-9 < x < b - width * 1e-9 else mid


def calibrate_noise(
    sample_rate: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    method: str | Mapping[str, Any] | TuningMethod = SINGLE,
    *,
    extra_rdp: np.ndarray | None = None,
    validation_noise: float | None = None,
    **params: Any,
) -> float:
    """Noise multiplier σ that makes one run (the default) or a whole tuning job (a method, or
    its kind and parameters as in :func:`~core.accounting.methods.tuning_epsilon`) cost
    ε ∈ [target·(1 − 10⁻³), target] at δ. A trial is DP-SGD composed with the private
    validation score's Gaussian (``validation_noise``) and with ``extra_rdp``; the job's ε is
    its method's (the smaller bound, for an ``rdp`` job with a ``pld_delta`` or a ``ps`` job with
    a ``profile_delta``), which needs the trial's mechanisms, so the PLD and profile bounds apply
    where there is no ``extra_rdp``."""
    target = checks.positive("target_epsilon", target_epsilon)
    checks.sample_rate(sample_rate)
    checks.count("steps", steps)
    checks.probability("delta", delta)
    charged = tuning_method(method, **params)
    extra = [] if validation_noise is None else [gaussian_rdp(validation_noise)]
    extra += [] if extra_rdp is None else [extra_rdp]
    composed = compose(*extra) if extra else None

    def cost(sigma: float) -> float:
        curve = trial_rdp(sample_rate, sigma, steps, composed)
        if extra_rdp is not None:
            return charged.epsilon(curve, delta)
        trial = TrialMechanism(
            sample_rate=sample_rate,
            noise_multiplier=sigma,
            steps=steps,
            validation_noise=validation_noise,
        )
        return charged.epsilon(curve, delta, (trial,))

    return solve_noise(cost, target)
