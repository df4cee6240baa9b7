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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from core.entropy import secure_generator
from core.spec import Choice, Dimension, Grid, LogUniform

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
