"""Privacy plan of a tuning job: the noise each trial runs with and what the job costs.

Every trial of a job runs the same (q, σ, T), so one RDP curve describes each trial and the
job's cost follows from the accounting method (``service.accounting.job_charge``). σ is
calibrated so that the job's ε at its δ lands at or just below the analyst's target — counting
every reserved retry, so the target holds even if all of them are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel

from service import accounting
from service.db import Dataset
from service.spec import MAX_TRIALS, JobSpec

MAX_STEPS = 1_000_000  # DP-SGD steps of one trial


class PlanError(ValueError):
    """A job that cannot run on this dataset; ``field`` names the spec field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TrialCount(BaseModel):
    distribution: Literal["fixed", "geometric_stopping", "truncated_negative_binomial", "poisson"]
    mean: float
    max: int  # the most trials the job may run (a cap under random stopping)
    eta: float | None = None


class Plan(BaseModel):
    """What the analyst sees before anything is reserved."""

    accounting: Literal["rdp", "lt", "ps"]
    sample_rate: float  # q = B / N
    steps: int  # T per trial
    noise_multiplier: float  # σ of each DP-SGD step
    gradient_noise_multiplier: float  # σ_T left for the gradient after a DC-SGD/Andrew split
    validation_noise: float | None  # σ of the private selection score, if any
    trials: TrialCount
    attempts_reserved: int | None  # rdp: K·(1 + max_retries) trial runs reserved
    trial_epsilon: float  # one trial's ε at the job's δ
    epsilon: float  # the job's ε ...
    delta: float  # ... at this δ
    params: dict[str, Any]  # the accounting parameters used (γ, δ₂, mean, η, cap)


@dataclass(frozen=True)
class PlannedJob:
    plan: Plan
    reservation: accounting.Charge  # the job's full cost, reserved at admission


def plan_job(spec: JobSpec, dataset: Dataset) -> PlannedJob:
    from workers.dp.sampling import num_steps  # torch-heavy: loaded on first plan only

    privacy = spec.privacy
    delta = privacy.delta if privacy.delta is not None else dataset.delta
    if delta > dataset.delta:
        raise PlanError("privacy.delta", f"{delta} exceeds the dataset's δ {dataset.delta}")
    if spec.batch_size > dataset.n:
        raise PlanError("batch_size", f"{spec.batch_size} exceeds the dataset size {dataset.n}")
    validation = spec.validation
    if validation.split == "public" and not dataset.public_validation:
        raise PlanError(
            "validation.split", "the dataset has no public validation split; use 'private'"
        )
    q = spec.batch_size / dataset.n
    steps = num_steps(dataset.n, spec.batch_size, spec.epochs)
    if steps > MAX_STEPS:
        raise PlanError("epochs", f"{steps} steps per trial exceed {MAX_STEPS}")
    params = _method_params(spec, delta)
    method = privacy.accounting
    noise = validation.noise if validation.split == "private" else None
    try:
        sigma = _calibrate(q, steps, privacy.epsilon, delta, method, noise,
                           tuple(sorted(params.items())))
    except ValueError as error:
        hint = f"; the private validation score (noise {noise}) costs part of it" if noise else ""
        raise PlanError("privacy.epsilon", f"{error}{hint}") from None
    extra = None if noise is None else accounting.gaussian_rdp(noise)
    trial = accounting.trial_rdp(q, sigma, steps, extra)
    plan = Plan(
        accounting=method,
        sample_rate=q,
        steps=steps,
        noise_multiplier=sigma,
        gradient_noise_multiplier=_gradient_noise(spec, sigma),
        validation_noise=noise,
        trials=_trial_count(spec, params, trial, delta),
        attempts_reserved=params.get("trials"),
        trial_epsilon=accounting.epsilon_from_rdp(trial, delta)[0],
        epsilon=accounting.job_epsilon(trial, delta, method, **params),
        delta=delta,
        params=params,
    )
    reservation = accounting.job_charge(trial, delta, method, **params)
    return PlannedJob(plan=plan, reservation=reservation)


def _method_params(spec: JobSpec, delta: float) -> dict[str, Any]:
    """Parameters of the job's accounting method for ``service.accounting``."""
    privacy = spec.privacy
    if privacy.accounting == "rdp":
        return {"trials": spec.trial_count() * (1 + privacy.max_retries)}
    if privacy.accounting == "lt":
        gamma = privacy.gamma if privacy.gamma is not None else 1 / privacy.expected_trials
        delta2 = privacy.delta2 if privacy.delta2 is not None else delta / 2
        if delta2 >= delta:
            raise PlanError("privacy.delta2", f"must be below the job's δ {delta}")
        return {"gamma": gamma, "delta2": delta2}
    eta = None if privacy.eta == "poisson" else privacy.eta
    cap = privacy.max_trials or _default_cap(privacy.mean, eta, delta)
    tail = accounting.trials_tail(privacy.mean, eta, cap)
    if tail >= delta:
        raise PlanError("privacy.max_trials", f"P[K > {cap}] = {tail:.3g} is not below δ")
    return {"mean": privacy.mean, "eta": eta, "max_trials": cap}


def _trial_count(
    spec: JobSpec, params: dict[str, Any], trial: np.ndarray, delta: float
) -> TrialCount:
    """How many trials the job runs: fixed K, or its distribution and cap."""
    if spec.privacy.accounting == "rdp":
        k = spec.trial_count()
        return TrialCount(distribution="fixed", mean=k, max=k)
    if spec.privacy.accounting == "lt":
        cap = accounting.liu_talwar(trial, delta, **params).max_trials
        if cap > MAX_TRIALS:
            raise PlanError("privacy.gamma", f"the cap on trials {cap} exceeds {MAX_TRIALS}")
        return TrialCount(distribution="geometric_stopping", mean=1 / params["gamma"], max=cap)
    eta = params["eta"]
    return TrialCount(
        distribution="poisson" if eta is None else "truncated_negative_binomial",
        mean=params["mean"], max=params["max_trials"], eta=eta,
    )


def _default_cap(mean: float, eta: float | None, delta: float) -> int:
    """Smallest cap on K whose tail probability is below δ/100 (bisection: the tail
    decreases in the cap)."""
    lo, hi = 1, MAX_TRIALS
    if accounting.trials_tail(mean, eta, hi) > delta / 100:
        raise PlanError("privacy.mean", f"K would exceed {MAX_TRIALS} trials too often")
    while lo < hi:
        mid = (lo + hi) // 2
        if accounting.trials_tail(mean, eta, mid) > delta / 100:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _gradient_noise(spec: JobSpec, sigma: float) -> float:
    """σ_T of the gradient when part of σ pays for a noisy statistic of the norms."""
    from workers.dp.adaptive import gradient_noise  # torch-heavy, like num_steps

    try:
        return gradient_noise(spec.method, spec.batch_size, sigma)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise PlanError(field, message) from None


@lru_cache(maxsize=256)
def _calibrate(
    q: float,
    steps: int,
    epsilon: float,
    delta: float,
    method: str,
    validation_noise: float | None,
    params: tuple[tuple[str, Any], ...],
) -> float:
    """Calibration bisects over σ (about a second); identical jobs reuse the answer."""
    extra = None if validation_noise is None else accounting.gaussian_rdp(validation_noise)
    return accounting.calibrate_noise(q, steps, epsilon, delta, method, extra_rdp=extra,
                                      **dict(params))
