"""The Ray Tune trainable of a tuning job: one attempt of one trial.

It lives in its own module (not in the driver, which runs as ``__main__``) so that Ray's
workers import it by name. Privacy bookkeeping happens where data is touched: the attempt is
recorded, and charged, through the control plane *before* the trial loads the dataset
(docs/design.md, invariant 2–3).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune
from safetensors.torch import save_file

from core.config import DatasetConfig, TrialConfig
from core.shapes import plan_shapes, shape_of
from core.spec import JobSpec
from runner.client import AttemptRefused, ControlPlane
from runner.search import Candidate, random_candidate
from workers.trial import run_trial

log = logging.getLogger("dptune.trial")

#: when this process had imported the trainable, torch and the engine with it: a trial's
#: timings tell a fresh process (just now) from a reused one (a trial ago)
IMPORTED_AT = time.time()


@dataclass(frozen=True)
class JobContext:
    """Everything a trial needs, shipped to each trial process by ``tune.with_parameters``.

    ``candidates`` lists a fixed-K job's candidates by trial index (each trial gets its own in
    its Tune config, :func:`param_space`); for a random-stopping job it is None and each trial
    draws its own from OS entropy (:func:`random_candidate`), so the driver never holds the
    order of candidates either: it learns each from the trial's reports, once drawn."""

    job_id: int
    control_url: str
    token: str
    data_dir: Path
    spec: dict[str, Any]
    plan: dict[str, Any]
    dataset: DatasetConfig
    trials: int
    candidates: list[Candidate] | None
    proxy: DatasetConfig | None = None  # the public dataset a proxy search runs on

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
    shape = shape_of(plan_shapes(ctx.plan), params)
    return JobSpec.model_validate(ctx.spec).trial_config(
        dataset or ctx.dataset, shape, ctx.plan["delta"], params
    )


def param_space(ctx: JobContext) -> dict[str, Any]:
    """Tune's search space: one Tune trial per trial index, ``{"trial": {"index": i,
    "params": candidate}}`` — a fixed-K trial's candidate in its config, so that Tune's tables
    (the job's log in the Ray dashboard) show its hyperparameters from the start. A
    random-stopping trial's config holds only its index: it draws its candidate itself."""
    trials = [
        {"index": i} if ctx.candidates is None else {"index": i, "params": ctx.candidates[i]}
        for i in range(ctx.trials)
    ]
    return {"trial": tune.grid_search(trials)}


def trial_index(config: dict[str, Any]) -> int:
    return int(config["trial"]["index"])


def run_candidate(config: dict[str, Any], ctx: JobContext) -> None:
    """The Ray Tune trainable: one attempt of trial ``config["trial"]["index"]``.

    Every report to Tune carries the trial's ε (one attempt's, at the job's δ) and, when the
    trial drew its candidate, that candidate as ``params``; the last one adds its DP
    selection score, ``dp_score``. They are Tune's, for the operator's dashboard: what the
    control plane records (and shows analysts) goes through ``api`` alone."""
    entered = time.time()
    index = trial_index(config)
    # as many torch threads as CPUs reserved: more oversubscribe a node shared by trials
    torch.set_num_threads(max(1, math.floor(ctx.spec["resources"]["cpu"])))
    api = ctx.control_plane()
    drawn = "params" not in config["trial"]
    params = random_candidate(ctx.spec["search_space"]) if drawn else config["trial"]["params"]
    shown = {"epsilon": ctx.plan["trial_epsilon"]} | ({"params": params} if drawn else {})
    try:
        # Charged before any data is read; refused when the reservation does not cover it
        # (a cancelled job, retries used up): then the trial ends without touching data.
        attempt = api.start_attempt(index, params, ray.get_runtime_context().get_node_id())
    except AttemptRefused as refused:
        log.warning("trial %d not run: %s", index, refused)
        return
    recorded = time.time()
    tune.report({"steps": 0, **shown})  # a trial that fails before its first epoch shows it too
    steps_run = 0

    def on_step(t: int, total: int) -> None:
        nonlocal steps_run
        steps_run = t

    def on_epoch(rows: list[dict[str, Any]]) -> None:
        api.progress(
            attempt, steps_run, [{**r, "public": r["visibility"] == "public"} for r in rows]
        )
        tune.report({"steps": steps_run, **shown, **{r["name"]: r["value"] for r in rows}})

    try:
        outcome = run_trial(
            trial_config(ctx, params), on_step=on_step, on_epoch=on_epoch, data_dir=ctx.data_dir
        )
    except BaseException as error:
        api.finish(attempt, "failed", steps_run)
        log.error("trial %d failed: %s", index, error)
        raise
    result = outcome.result
    # where its start-up went, in its Tune results for the operator (bench/job_overhead.py)
    timings = {"imported_at": IMPORTED_AT, "entered_at": entered, "attempt_s": recorded - entered}
    path = ctx.weights_path(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in outcome.model.state_dict().items()}, str(path)
    )
    api.finish(
        attempt, "succeeded", result["steps"], result["score"]["value"], result["thresholds"]
    )
    tune.report(
        {"steps": result["steps"], **shown, "dp_score": result["score"]["value"]}
        | {"timings": timings | result["timings"]}
    )


def run_on_proxy(config: dict[str, Any], ctx: JobContext) -> None:
    """The Ray Tune trainable of a proxy search: one candidate trained on the job's public
    proxy, as it would train on the private data (its shape's B, epochs and σ). It reads no
    private data, so nothing is recorded with the control plane, nor charged; its score is
    Tune's, and picks the candidate that then trains on the private data."""
    assert ctx.proxy is not None
    torch.set_num_threads(max(1, math.floor(ctx.spec["resources"]["cpu"])))
    params = config["trial"]["params"]
    result = run_trial(trial_config(ctx, params, ctx.proxy), data_dir=ctx.data_dir).result
    tune.report({"steps": result["steps"], "dp_score": result["score"]["value"]})


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
