"""Noise calibration: the smallest σ whose cost lands at or just below a target ε."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from core.accounting import checks
from core.accounting.charges import trial_rdp
from core.accounting.methods import SINGLE, TuningMethod, tuning_method

#: calibrated ε lies in [target·(1 − RELATIVE_TOLERANCE), target]
RELATIVE_TOLERANCE = 1e-3
SIGMA_MIN, SIGMA_MAX = 1e-2, 1e4


def _bisect(cost: Callable[[float], float], target: float) -> float:
    """Largest-cost σ with cost(σ) ≤ target, to the relative tolerance, for a cost that
    decreases in σ. Bisection in log σ keeps the step relative over the whole bracket."""
    lo, hi = SIGMA_MIN, 1.0
    while cost(hi) > target:
        lo, hi = hi, hi * 2
        if hi > SIGMA_MAX:
            raise ValueError(
                f"target_epsilon {target} is too small: even noise_multiplier {SIGMA_MAX:g} "
                "costs more"
            )
    if cost(lo) <= target:
        return lo  # the target is looser than any noise we would ever recommend
    for _ in range(200):
        eps_hi = cost(hi)
        if eps_hi >= target * (1 - RELATIVE_TOLERANCE):
            break
        mid = math.sqrt(lo * hi)
        if cost(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def calibrate_noise(
    sample_rate: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    method: str | Mapping[str, Any] | TuningMethod = SINGLE,
    *,
    extra_rdp: np.ndarray | None = None,
    **params: Any,
) -> float:
    """Noise multiplier σ that makes one run (the default) or a whole tuning job (a method, or
    its kind and parameters as in :func:`~core.accounting.methods.tuning_epsilon`) cost
    ε ∈ [target·(1 − 10⁻³), target] at δ."""
    target = checks.positive("target_epsilon", target_epsilon)
    checks.sample_rate(sample_rate)
    checks.count("steps", steps)
    checks.probability("delta", delta)
    charged = tuning_method(method, **params)

    def cost(sigma: float) -> float:
        return charged.epsilon(trial_rdp(sample_rate, sigma, steps, extra_rdp), delta)

    return _bisect(cost, target)
