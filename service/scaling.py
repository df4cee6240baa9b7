"""The privacy plan of a scaling job: cheap runs at a few privacy levels, then one final run
(Panda et al., "A New Linear Scaling Rule for Private Adaptive Hyperparameter Optimization",
ICML 2024; the spec's ``scaling``, :class:`core.spec.Scaling`).

Every run is a fixed mechanism — every candidate learning rate at each level, then the one
final run, whose lr the runner computes from the cheap runs' released DP scores
(post-processing) — so the job costs exactly the composition of all its runs, every reserved
retry included: C·(1 + retries) runs at each level and 1 + retries final runs. It is stated
by the smaller of two sound bounds, as a fixed-K job of one shape is
(:class:`core.accounting.Rdp`): their RDP curves summed (not K times the largest), and their
pessimistic PLDs composed, at the δ of the job's PLD statement. The final run's σ is
calibrated so that the job lands at or just below its target ε; the cheap levels' σs come
first, from the analyst's per-run εs or, by default, from the share of the target their RDP
composition may take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from scipy.optimize import brentq

from core import accounting
from core.noise import gradient_noise
from core.plan import Level, ScalingPlan, TrialCount
from core.shapes import Shape
from core.spec import DEFAULT_LEVELS, DEFAULT_SHARE, JobSpec
from service import planning

#: the default levels' σ relative to the first level's: each has half the noise of the one
#: before, so about twice the ε of one run; points as far apart as a small share allows, so
#: that the fitted slope is not lost in the noise of the scores
DEFAULT_SIGMA_RATIOS = tuple(0.5**level for level in range(DEFAULT_LEVELS))
#: the bounds of a default cheap level's σ (``core.accounting.calibration``'s)
SIGMA_MIN, SIGMA_MAX = accounting.calibration.SIGMA_MIN, accounting.calibration.SIGMA_MAX


def plan_scaling(planned: planning.PlannedJob) -> planning.PlannedJob:
    """The scaling job ``planned`` as a fixed-K job of one shape was planned (its shape,
    δ, validation noise, PLD statement's δ and defaults), given one shape per level and the
    final run's, and the reservation of their exact composition."""
    spec, plan = planned.spec, planned.plan
    assert spec.scaling is not None and isinstance(plan.method, accounting.Rdp)
    [shape] = plan.shapes
    delta, noise = plan.delta, plan.validation_noise
    attempts = 1 + spec.privacy.max_retries
    candidates = spec.candidate_count()
    sigmas, defaults = _level_noise(spec, shape, delta, noise, candidates * attempts)
    level_runs = [_mechanism(shape, s, noise) for s in sigmas]
    cheap_runs = [run for run in level_runs for _ in range(candidates)]
    cheap = candidates * attempts * accounting.compose(*(run.rdp() for run in level_runs))
    count = spec.trial_count()
    method = accounting.Rdp(trials=count * attempts, pld_delta=plan.method.pld_delta)

    def job(final: float) -> tuple[np.ndarray, list[accounting.TrialMechanism]]:
        """The job's runs composed (their curves summed) and the runs, the final one at σ
        ``final``."""
        last = _mechanism(shape, final, noise)
        return cheap + attempts * last.rdp(), [*cheap_runs, last]

    def cost(final: float) -> float:
        total, runs = job(final)
        return method.epsilon(total / method.trials, delta, runs)

    final = _final_noise(spec, cost)
    shapes = [
        _level_shape(spec, shape, sigma, delta, noise, level)
        for level, sigma in enumerate([*sigmas, final])
    ]
    total, mechanisms = job(final)
    trial = total / method.trials

    def level(run: Shape, trials: int) -> Level:
        return Level(
            epsilon=run.trial_epsilon, noise_multiplier=run.noise_multiplier, trials=trials
        )

    update = {
        "sample_rate": None,
        "steps": None,
        "noise_multiplier": None,
        "gradient_noise_multiplier": None,
        "shapes": shapes,
        "trials": TrialCount(distribution="fixed", mean=count, max=count),
        "attempts_reserved": method.trials,
        "trial_epsilon": max(s.trial_epsilon for s in shapes),
        "epsilon": method.epsilon(trial, delta, mechanisms),
        "method": method,
        "bound": method.bound(trial, delta, mechanisms),
        "defaults": plan.defaults | defaults,
        "scaling": ScalingPlan(
            levels=[level(s, candidates) for s in shapes[:-1]],
            final=level(shapes[-1], 1),
            cheap_epsilon=accounting.epsilon_from_rdp(cheap, delta)[0],
        ),
    }
    pld = method.charge(trial, delta, spec.privacy.epsilon, mechanisms).pld
    return replace(
        planned,
        plan=plan.model_copy(update=update),
        reservation=accounting.Charge(rdp=total, pld=pld),
    )


def _mechanism(shape: Shape, sigma: float, noise: float | None) -> accounting.TrialMechanism:
    """One run at the job's shape and noise ``sigma``."""
    return accounting.TrialMechanism(
        sample_rate=shape.sample_rate,
        noise_multiplier=sigma,
        steps=shape.steps,
        validation_noise=noise,
    )


def _curve(shape: Shape, sigma: float, noise: float | None) -> np.ndarray:
    """One run's curve at the job's shape and noise ``sigma``."""
    return _mechanism(shape, sigma, noise).rdp()


def _level_noise(
    spec: JobSpec, shape: Shape, delta: float, noise: float | None, runs: int
) -> tuple[list[float], dict[str, str]]:
    """σ of each cheap level, and the defaults explained: one run at each given level costs
    its ε; by default, the levels' σs stand in :data:`DEFAULT_SIGMA_RATIOS` and all cheap runs
    together cost the share of the target."""
    assert spec.scaling is not None
    target = spec.privacy.epsilon
    if spec.scaling.levels is not None:
        if spec.scaling.levels[-1] >= target:
            raise planning.PlanError(
                "scaling.levels", f"each level's ε must be below the job's ε {target:g}"
            )
        try:
            return [
                accounting.calibrate_noise(
                    shape.sample_rate, shape.steps, e, delta, validation_noise=noise
                )
                for e in spec.scaling.levels
            ], {}
        except ValueError as error:
            raise planning.PlanError("scaling.levels", str(error)) from None
    share = spec.scaling.share if spec.scaling.share is not None else DEFAULT_SHARE
    first = _first_sigma(shape, delta, noise, runs, share * target)
    sigmas = [first * ratio for ratio in DEFAULT_SIGMA_RATIOS]
    explained = {
        "scaling.levels": (
            f"{len(sigmas)} levels at σ {', '.join(f'{s:.4g}' for s in sigmas)} (σ ratios "
            f"{', '.join(f'{r:g}' for r in DEFAULT_SIGMA_RATIOS)}: each level about twice the "
            "ε of the one before, two points far enough apart for the fitted slope to stand "
            f"out of the scores' noise), so that the {runs} runs reserved at each level cost "
            f"{share:g} of the job's ε together; the final run gets the rest."
        )
    }
    if spec.scaling.share is None:
        explained["scaling.share"] = (
            f"{DEFAULT_SHARE:g}: Panda et al. spend a small part of the budget on the cheap "
            "runs; with several candidates at each level, half keeps their scores informative "
            "while the final run, the released model, still runs at most of the budget's ε."
        )
    return sigmas, explained


def _first_sigma(shape: Shape, delta: float, noise: float | None, runs: int, goal: float) -> float:
    """σ of the first default level such that ``runs`` runs at every level (σs in
    :data:`DEFAULT_SIGMA_RATIOS`) compose to ``goal`` at δ (to a relative 10⁻³; the final
    run's calibration makes the job's total exact). ε falls as σ grows: a bracket in ln σ by
    doubling, then Brent's method on ln ε − ln goal."""

    def gap(log_sigma: float) -> float:
        sigma = math.exp(log_sigma)
        curves = [_curve(shape, sigma * r, noise) for r in DEFAULT_SIGMA_RATIOS]
        return math.log(accounting.epsilon_from_rdp(runs * sum(curves), delta)[0] / goal)

    if gap(math.log(SIGMA_MIN)) <= 0:
        return SIGMA_MIN  # a share looser than any noise the planner would recommend
    why = (
        "their private validation scores alone may"
        if noise is not None
        else f"{runs} runs at each level are too many for so small a share"
    )
    low, high = _bracket(gap, math.log(SIGMA_MIN), math.log(SIGMA_MAX), why)
    return math.exp(brentq(gap, low, high, xtol=1e-4))


def _bracket(
    gap: Callable[[float], float], log_min: float, log_max: float, why: str
) -> tuple[float, float]:
    """(low, high) in ln σ with gap(low) > 0 ≥ gap(high), from σ = 1 by doubling or halving
    (gap(``log_min``) > 0); none: the plan is refused, saying ``why``."""
    step = math.log(2)
    x, value = 0.0, gap(0.0)
    while value > 0:  # too little noise: double σ
        x += step
        if x > log_max:
            raise planning.PlanError(
                "scaling.share",
                f"the cheap runs cost more than their share of ε even at σ {SIGMA_MAX:g} ({why})",
            )
        value = gap(x)
        if value <= 0:
            return x - step, x
    while value <= 0:  # more noise than needed: halve σ
        if x - step <= log_min:
            return log_min, x
        x -= step
        value = gap(x)
    return x, x + step


def _final_noise(spec: JobSpec, cost: Callable[[float], float]) -> float:
    """σ of the final run: the job's ε at δ, ``cost`` of that σ (every run composed, the
    smaller of RDP and PLD), lands at or just below the job's target."""
    try:
        return accounting.solve_noise(cost, spec.privacy.epsilon)
    except ValueError:
        field = "scaling.levels" if spec.scaling and spec.scaling.levels else "scaling.share"
        raise planning.PlanError(
            field, f"the cheap runs leave nothing of the job's ε {spec.privacy.epsilon:g}"
        ) from None


def _level_shape(
    spec: JobSpec, shape: Shape, sigma: float, delta: float, noise: float | None, level: int
) -> Shape:
    try:
        grad = gradient_noise(spec.method, shape.batch_size, sigma)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise planning.PlanError(field, message) from None
    return Shape.model_validate(
        shape.model_dump()
        | {
            "noise_multiplier": sigma,
            "gradient_noise_multiplier": grad,
            "trial_epsilon": accounting.epsilon_from_rdp(_curve(shape, sigma, noise), delta)[0],
            "level": level,
        }
    )
