"""Trial shapes: the batch size and epochs a trial runs with, and the noise each shape gets.

Batch size B and epochs set a trial's sample rate q = B/N and its steps T, hence the noise σ it
needs for a given ε. A job that searches them (``search_space.batch_size``, ``.epochs``) has
one *shape* per combination, and the planner (``service.planning``) gives each shape its own σ
so that every shape's trial costs the same ε. How the job is charged then depends on how its
trials come to their shapes:

- ``rdp``: the shapes are a grid, so each runs equally often (a grid product) and K trials
  cost exactly the sum of their own curves: K times the shapes' mean curve.
- ``lt`` / ``ps``: each trial draws its shape independently of the data, and releases it with
  its model. Given the draw, the trial is that shape's mechanism, so its Rényi divergence is
  ln E_s[exp((α − 1)·D_α(shape s))]/(α − 1) ≤ max_s D_α(shape s): the pointwise maximum of the
  shapes' curves bounds every trial, and the random-stopping bounds apply to it (Papernot &
  Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022, state theirs for
  any mechanism with a given RDP curve; Liu–Talwar's for any (ε, δ)-DP trial).
- a search on a public ``proxy``: the one private trial runs the shape the public search chose,
  also independently of the private data, so the same maximum bounds it.

A job that searches neither has one shape: the spec's own B and epochs. A ``scaling`` job
(cheap runs at a few privacy levels, then one final run: ``core.spec.Scaling``) has one shape
per level, all of one (B, epochs), each with its own σ; a run names its level in its
parameters (``scaling.level``), so that its attempts are charged that level's curve, and each
level runs as many times as the plan says (:func:`reserved_attempts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.accounting import TrialMechanism

#: the spec fields that set a trial's shape; searchable, each candidate getting its own σ
SHAPE_PATHS = ("batch_size", "epochs")
#: a scaling job's run names its level (its shape) under this key (``core.spec.LEVEL``)
LEVEL_PATH = "scaling.level"


class Shape(BaseModel):
    """One (B, epochs) a job's trials may run with, and the privacy the plan gives it."""

    model_config = ConfigDict(frozen=True)

    batch_size: int = Field(ge=1)
    epochs: float = Field(gt=0)
    sample_rate: float = Field(gt=0, le=1)  # q = B / N
    steps: int = Field(ge=1)  # T
    noise_multiplier: float = Field(gt=0)  # σ of each DP-SGD step
    gradient_noise_multiplier: float = Field(gt=0)  # σ_T left after an adaptive rule's share
    trial_epsilon: float = Field(gt=0)  # one trial of this shape, at the job's δ
    level: int | None = Field(None, ge=0)  # a scaling job's level (the final run's: the last)

    def mechanism(self, validation_noise: float | None) -> TrialMechanism:
        return TrialMechanism(
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            steps=self.steps,
            validation_noise=validation_noise,
        )

    def matches(self, params: Mapping[str, Any]) -> bool:
        """Whether a candidate's hyperparameters (search-space path → value) select this shape;
        a path the candidate leaves out is not searched, so every shape shares it; a scaling
        job's run selects its level's shape, and only it."""
        same = all(params[p] == getattr(self, p) for p in SHAPE_PATHS if p in params)
        return same and params.get(LEVEL_PATH) == self.level


def plan_shapes(plan: Mapping[str, Any]) -> list[Shape]:
    """The shapes of a stored plan (``Plan.shapes``)."""
    return [Shape.model_validate(s) for s in plan["shapes"]]


def reserved_attempts(plan: Mapping[str, Any], shape: Shape) -> int:
    """The attempts a fixed-K plan reserved for trials of ``shape``: an equal share of all of
    them for a grid of shapes (each runs equally often), or a scaling level's runs, each with
    the plan's retries (``Plan.scaling``)."""
    if shape.level is None:
        return int(plan["attempts_reserved"]) // len(plan["shapes"])
    per_trial = int(plan["attempts_reserved"]) // int(plan["trials"]["max"])
    scaling = plan["scaling"]
    levels = [*scaling["levels"], scaling["final"]]
    return int(levels[shape.level]["trials"]) * per_trial


def shape_of(shapes: Sequence[Shape], params: Mapping[str, Any]) -> Shape:
    """The one shape a candidate runs with; ValueError when it names none, or is ambiguous."""
    found = [s for s in shapes if s.matches(params)]
    if len(found) != 1:
        chosen = {p: params.get(p) for p in SHAPE_PATHS}
        raise ValueError(f"{chosen} selects {len(found)} of the plan's {len(shapes)} shapes")
    return found[0]


def trial_curve(
    shapes: Sequence[Shape], validation_noise: float | None, any_one: bool
) -> np.ndarray:
    """The curve that charges one trial of the job (see the module's docstring): the shapes'
    mean for a fixed-K grid, every shape running equally often; their pointwise maximum when a
    trial may run ``any_one`` of them (random stopping, or a shape chosen on a proxy)."""
    return combine([shape_curve(s, validation_noise) for s in shapes], any_one)


def combine(curves: Sequence[np.ndarray], any_one: bool) -> np.ndarray:
    """One trial's charging curve from its shapes' curves: their pointwise maximum when a
    trial may run ``any_one`` of them, else their mean (see :func:`trial_curve`)."""
    stacked = np.stack(curves)
    return np.asarray(stacked.max(axis=0) if any_one else stacked.mean(axis=0))


@lru_cache(maxsize=1024)
def shape_curve(shape: Shape, validation_noise: float | None) -> np.ndarray:
    """One trial's RDP curve for a shape. Memoized (a curve costs about 0.2 s, and the ledger
    charges each attempt by its shape's), read-only so that no caller changes the cached one."""
    curve = shape.mechanism(validation_noise).rdp()
    curve.setflags(write=False)
    return curve
