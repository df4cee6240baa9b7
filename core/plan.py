"""The plan of a tuning job: what the analyst sees before anything is reserved, what the
job's admission stores, and what the runner reads (``runner.job.JobContext``): the noise each
trial runs with, how many trials, and what the job costs. :mod:`service.planning` makes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from core.accounting import TuningMethod
from core.config import ModelReport
from core.shapes import Shape


class TrialCount(BaseModel):
    distribution: Literal["fixed", "geometric_stopping", "truncated_negative_binomial", "poisson"]
    mean: float
    max: int  # the most trials the job may run (a cap under random stopping)
    eta: float | None = None


class ProxySearch(BaseModel):
    """A search on public data: ``trials`` candidates train on dataset ``dataset`` (free), of
    ``size`` examples, each shape at its own sampling rate q and steps T there
    (:func:`proxy_batch_size`). None in a plan made before sizes were recorded."""

    dataset: int
    trials: int
    size: int | None = None


class Level(BaseModel):
    """One privacy level of a scaling job (``core.spec.Scaling``): its runs' σ and ε."""

    epsilon: float  # one run's ε at the job's δ
    noise_multiplier: float  # σ of each DP-SGD step of its runs
    trials: int  # runs at this level: every candidate learning rate, or the final run


class ScalingPlan(BaseModel):
    """The privacy levels of a scaling job, whose shapes (``Plan.shapes``) are one per level,
    the final run's last: the cheap levels in ascending ε, each run by every candidate, and
    the final run's. The line fitted through the levels' best r = lr·T is the runner's output
    (the final run's parameters carry it), not the plan's."""

    levels: list[Level]
    final: Level
    cheap_epsilon: float  # all cheap runs (every attempt reserved), their RDP composed, at δ


def score_std(noise: float, fraction: float, size: int) -> float:
    """The standard deviation of the noise released with a private selection score, σ_v/(f·N):
    the score is a count over the f·N examples expected held out (``workers.trial``)."""
    return noise / (fraction * size)


def proxy_batch_size(sample_rate: float, size: int) -> int:
    """The batch a shape of sampling rate q = B/N runs on a proxy of ``size`` examples: q·size
    rounded (at least 1), so that with the shape's epochs it runs the same T = epochs/q steps
    at the same q and σ — the candidate meets the noise it will meet on the private data,
    whether the proxy is smaller or larger than it."""
    return max(1, round(sample_rate * size))


class Plan(BaseModel):
    """What the analyst sees before anything is reserved."""

    accounting: Literal["rdp", "lt", "ps"]
    #: the next four describe every trial when the job has one shape; None when it searches
    #: batch size or epochs (then ``shapes`` lists each one's)
    sample_rate: float | None  # q = B / N
    steps: int | None  # T per trial
    noise_multiplier: float | None  # σ of each DP-SGD step
    gradient_noise_multiplier: float | None  # σ_T left for the gradient after a DC-SGD/Andrew split
    shapes: list[Shape]  # each (batch_size, epochs) a trial may run with: its q, T and σ
    validation_noise: float | None  # σ of the private selection score, if any
    #: the standard deviation of the noise the release adds to a private selection score,
    #: σ_v/(f·N) (the score is a count over the f·N examples expected held out): how far apart
    #: two trials' scores must be to tell them apart. None for a public score, or in a plan
    #: made before it was recorded.
    score_std: float | None = None
    trials: TrialCount
    attempts_reserved: int | None  # rdp: K·(1 + max_retries) trial runs reserved
    trial_epsilon: float  # one trial's ε at the job's δ (the largest of the shapes')
    epsilon: float  # the job's ε ...
    delta: float  # ... at this δ
    method: TuningMethod  # how the trials are charged: kind and parameters
    #: the bound that states the job, the smaller: ps: Papernot–Steinke's RDP bound, or the
    #: privacy-profile bound (an (ε, δ) charge at ``method.profile_delta``); rdp: RDP
    #: composition, or the PLD of the K-fold composition (an (ε, δ) statement at
    #: ``method.pld_delta``, one shape only); None for lt, or in a plan made before
    bound: Literal["rdp", "profile", "pld"] | None = None
    defaults: dict[str, str]  # spec field -> the value the planner filled in, and why
    model: ModelReport | None = None  # an imported model's inspection (service.own_models)
    proxy: ProxySearch | None = None  # the search on a public proxy, if any
    scaling: ScalingPlan | None = None  # cheap runs at these levels, then one final run
