"""Which trials a tuning job runs: the candidates (how many, under random stopping, the job's
tuning method draws: ``core.accounting.methods``).

- ``rdp`` (fixed K): every point of the grid product, each paired with ``trials`` random draws
  of the random dimensions. Every trial is charged, so any search is allowed.
- ``lt`` / ``ps`` (random K): K is drawn from the accounting distribution and each trial
  draws its candidate i.i.d. from the fixed prior given by the search space (docs/design.md
  invariant 6). K and the order of the candidates must stay secret — the bounds of Liu–Talwar
  and Papernot–Steinke hold for a random K of which only the winner is released — so both come
  from OS entropy (:func:`~core.entropy.secure_generator`), never from a seed the analyst
  chose: replaying such a seed would tell which draw the released hyperparameters were, hence
  a lower bound on K.
- ``scaling`` (fixed K): every candidate learning rate at each cheap privacy level, scaled
  down to it, then one final run whose lr is extrapolated from the levels' best (Panda et al.,
  "A New Linear Scaling Rule for Private Adaptive Hyperparameter Optimization", ICML 2024):
  the best r = lr·T scales linearly with ε.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from core.entropy import secure_generator
from core.plan import Plan
from core.spec import (
    LEVEL,
    LR,
    SCALING_FIT,
    Choice,
    Dimension,
    Grid,
    JobSpec,
    LogUniform,
)

Candidate = dict[str, Any]


def _draw(dimension: Choice | LogUniform, rng: np.random.Generator) -> Any:
    if isinstance(dimension, Choice):
        return dimension.values[int(rng.integers(len(dimension.values)))]
    low, high = dimension.log_uniform
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def candidates(search_space: Mapping[str, Dimension], count: int, seed: int) -> list[Candidate]:
    """Fixed-K (``rdp``) jobs: grid points × ``count`` i.i.d. draws of the random dimensions
    (only the draws when there is no grid), reproducible from the job's ``seed`` — every
    trial's outcome is released and charged anyway. ``search_space`` maps a dotted path to its
    dimension (``JobSpec.search_space``)."""
    rng = np.random.default_rng(seed)
    grid = {p: d.grid for p, d in search_space.items() if isinstance(d, Grid)}
    random = {p: d for p, d in search_space.items() if not isinstance(d, Grid)}
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    return [
        {**point, **{p: _draw(d, rng) for p, d in random.items()}}
        for point in points
        for _ in range(count)
    ]


def random_candidate(
    search_space: Mapping[str, Dimension], rng: np.random.Generator | None = None
) -> Candidate:
    """One candidate of a random-stopping job, drawn from the prior with OS entropy."""
    rng = rng or secure_generator()
    return {path: _draw(dimension, rng) for path, dimension in search_space.items()}


def scaling_candidates(spec: JobSpec, plan: Plan) -> list[Candidate]:
    """A scaling job's cheap runs (``core.spec.Scaling``), level by level: every candidate
    learning rate (the fixed-K candidates, from the job's seed) scaled down by the level's ε
    over the final run's. Those are the rates the rule makes the candidates' equivalents at the
    level (r = lr·T ∝ ε, T fixed): the levels search where their best should be. Unscaled, a
    grid of final rates is several times too large at every cheap level. There a few noisy
    steps diverge at each rate, and the level's best is noise. Each names its level, whose
    planned σ it runs with (:mod:`core.shapes`)."""
    assert plan.scaling is not None
    final = plan.scaling.final.epsilon
    lrs = candidates(spec.search_space, spec.privacy.trials or 1, spec.seed or 0)
    return [
        {**c, LR: c[LR] * level.epsilon / final, LEVEL: index}
        for index, level in enumerate(plan.scaling.levels)
        for c in lrs
    ]


def fit_slope(points: Sequence[tuple[float, float]]) -> float:
    """The slope a of the line through the origin, r = a·ε, fitted to (ε, r) points on a log
    scale with weights ε²: a = exp(Σ ε²·ln(r/ε) / Σ ε²). Panda et al.'s rule scales the best r
    linearly with ε; with no intercept one number is fitted from every level, so the
    extrapolation to the final run's several times larger ε carries the levels' noise once,
    where a free intercept multiplies the difference of two noisy points by that distance (a
    flat or falling line from tied or swapped levels). Learning rates are searched on a
    geometric grid, and a level's best is one of its points: on a log scale a cheap level's
    noisy pick of the largest rate moves a by its weight's share of the grid's log-width, not
    by the largest rate's share of the sum (as least squares in r would); the weights ε² give
    the levels with more ε, whose best is less noisy, more say."""
    weights = [e * e for e, _ in points]
    logs = [math.log(r / e) for e, r in points]
    return math.exp(sum(w * x for w, x in zip(weights, logs, strict=True)) / sum(weights))


def level_picks(
    spec: JobSpec, plan: Plan, finished: Sequence[tuple[Candidate, float]]
) -> list[tuple[float, float]]:
    """(ε, lr) of each cheap level's best-scoring finished run, from the finished cheap
    runs' (parameters, DP score); a level with none finished is left out."""
    assert plan.scaling is not None
    picks = []
    for level, planned in enumerate(plan.scaling.levels):
        scores = {i: score for i, (c, score) in enumerate(finished) if c[LEVEL] == level}
        best = spec.selection.best(scores)
        if best is not None:
            picks.append((planned.epsilon, finished[best][0][LR]))
    return picks


def final_candidate(
    spec: JobSpec, plan: Plan, finished: Sequence[tuple[Candidate, float]]
) -> Candidate | None:
    """The final run of a scaling job, from its finished cheap runs' (parameters, DP score):
    at each level the best score's r = lr·T (:func:`level_picks`), the line r = a·ε fitted
    through the levels' (ε, r) (:func:`fit_slope`), and lr = r/T at the final run's ε. With
    the levels' rates scaled (:func:`scaling_candidates`) that lr is the levels' picks,
    unscaled, their geometric mean with weights ε²: within the searched rates. Its parameters
    carry the fit (:data:`core.spec.SCALING_FIT`). None when no cheap run finished."""
    assert plan.scaling is not None
    steps = plan.shapes[-1].steps
    points = [(epsilon, lr * steps) for epsilon, lr in level_picks(spec, plan, finished)]
    if not points:
        return None
    slope = fit_slope(points)
    r = slope * plan.scaling.final.epsilon
    fit = dict(zip(SCALING_FIT, (slope, r), strict=True))
    return {LR: r / steps, LEVEL: len(plan.scaling.levels), **fit}
