"""What the tuning job's driver and its trial processes share: the job's context, its trials'
configurations and Tune's search space, the callback that marks dead attempts, and
:func:`run`, the function the driver hands Tune (with the wait of a job that holds its
release: :func:`hold`).

Nothing here imports torch: the driver imports this module, and importing torch and the
engine would delay every job's start before its first trial process could begin. The
trial code (:mod:`runner.trainable`) is imported by :func:`run`, in the trial's process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from ray import tune

from core.config import DatasetConfig, TrialConfig
from core.plan import Plan
from core.shapes import shape_of
from core.spec import LEVEL, JobSpec
from runner.client import ControlPlane, ControlPlaneError
from runner.search import Candidate

log = logging.getLogger("dptune.job")


@dataclass(frozen=True)
class JobContext:
    """Everything a trial needs, shipped to each trial process by ``tune.with_parameters``.

    ``candidates`` lists a fixed-K job's candidates by trial index (each trial gets its own in
    its Tune config, :func:`param_space`); for a random-stopping job it is None and each trial
    draws its own from OS entropy (:func:`runner.search.random_candidate`), so the driver
    never holds the order of candidates either: it learns each from the trial's reports, once
    drawn."""

    job_id: int
    control_url: str
    token: str
    data_dir: Path
    spec: JobSpec
    plan: Plan
    dataset: DatasetConfig
    trials: int
    candidates: list[Candidate] | None
    proxy: DatasetConfig | None = None  # the public dataset a proxy search runs on
    first: int = 0  # the first trial index this search runs (a scaling job's final run: the last)

    @property
    def holds_release(self) -> bool:
        """Whether the job holds its release (``privacy.hold_release``, random stopping only)
        and, as long, its cluster resources."""
        return self.spec.privacy.hold_release

    def control_plane(self) -> ControlPlane:
        return _control_plane(self.control_url, self.token, self.job_id)

    def weights_path(self, index: int) -> Path:
        return self.data_dir / "jobs" / str(self.job_id) / f"trial-{index}.safetensors"


@functools.lru_cache(maxsize=4)
def _control_plane(url: str, token: str, job_id: int) -> ControlPlane:
    """One HTTP client (and connection pool) per process, however many trials it runs."""
    return ControlPlane(url, token, job_id)


def trial_config(
    ctx: JobContext, params: Candidate, dataset: DatasetConfig | None = None
) -> TrialConfig:
    """A candidate's trial with its shape's planned noise, on the job's dataset (or another:
    its proxy). All of its privacy randomness comes from fresh OS entropy inside the trial
    (:mod:`workers.dp.randomness`)."""
    shape = shape_of(ctx.plan.shapes, params)
    return ctx.spec.trial_config(dataset or ctx.dataset, shape, ctx.plan.delta, params)


def param_space(ctx: JobContext) -> dict[str, Any]:
    """Tune's search space: one Tune trial per trial index, ``{"trial": {"index": i,
    "params": candidate}}`` — a fixed-K trial's candidate in its config, so that Tune's tables
    (the job's log in the Ray dashboard) show its hyperparameters from the start. A
    random-stopping trial's config holds only its index: it draws its candidate itself."""
    trials = [
        {"index": i} if ctx.candidates is None else {"index": i, "params": ctx.candidates[i]}
        for i in range(ctx.first, ctx.trials)
    ]
    return {"trial": tune.grid_search(trials)}


def shown_paths(spec: JobSpec) -> list[str]:
    """The parameters the job's tables show: the searched paths and, for a scaling job, each
    run's level (every run's config has one; the final run's fitted line is printed after the
    table, :func:`runner.summary.show`)."""
    return [*spec.search_space, *([LEVEL] if spec.scaling is not None else [])]


def trial_index(config: dict[str, Any]) -> int:
    return int(config["trial"]["index"])


def run(config: dict[str, Any], ctx: JobContext, proxy: bool = False) -> None:
    """The Ray Tune trainable of the job's trials (``proxy``: of its proxy search), as
    :func:`runner.trainable.run_candidate` and :func:`runner.trainable.run_on_proxy` run them.
    Tune ships this function to each trial process by name; the import below runs there, once
    per process, and never in the driver."""
    from runner import trainable  # torch and the engine: in the trial's process only

    if proxy:
        trainable.run_on_proxy(config, ctx)
        return
    try:
        trainable.run_candidate(config, ctx)
    finally:
        if ctx.holds_release and trial_index(config) == ctx.trials - 1:
            hold(ctx.control_plane().hold_left)


#: the longest pause between two asks of a hold whose control plane did not answer (s)
HOLD_RETRY_MAX_S = 30.0


def hold(seconds_left: Callable[[], float], sleep: Callable[[float], None] = time.sleep) -> None:
    """The last trial of a job that holds its release waits, in its process and so with the
    CPUs and GPUs Tune gave it, until the control plane's hold ends
    (:func:`core.hold.hold_until`): the job runs its trials one at a time in one process
    (:func:`runner.driver.tune_config`), so from its first trial to the hold's end it keeps one
    trial's resources whatever K, and no other job's start or attempt times tell K
    (docs/design.md, invariant 11). ``seconds_left`` asks the control plane, whose clock
    alone times the hold. A call that fails (no connection, a timeout, an error status) does
    not end the wait, since freeing the resources early would move other jobs' attempts with
    K: it asks again, backing off up to :data:`HOLD_RETRY_MAX_S`, until the control plane
    answers. Only the end of the job's Ray job (a cancel, an operator) ends the wait sooner."""
    while (left := _answer(seconds_left, sleep)) > 0:
        sleep(left)


def _answer(seconds_left: Callable[[], float], sleep: Callable[[float], None]) -> float:
    """The control plane's first answer to ``seconds_left``, asked again after each call that
    fails, backing off exponentially up to :data:`HOLD_RETRY_MAX_S`."""
    delay = 1.0
    while True:
        try:
            return seconds_left()
        except (ControlPlaneError, httpx.HTTPError) as error:
            log.warning(
                "hold: the control plane did not answer (%s); again in %.0f s", error, delay
            )
            sleep(delay)
            delay = min(2 * delay, HOLD_RETRY_MAX_S)


class AttemptRecorder(tune.Callback):
    """Tune callback on the driver: when a trial's process dies without reporting (killed,
    out of memory), the attempt it had started is marked failed — it stays charged. Tune calls
    ``on_trial_recover`` when it will retry the trial and ``on_trial_error`` when it will not;
    both run before any retry starts, so only the dead attempt is still open."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.ctx.control_plane().fail_open(trial_index(trial.config))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.ctx.control_plane().fail_open(trial_index(trial.config))
