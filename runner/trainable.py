"""One attempt of one trial of a tuning job, in a Ray Tune trial process.

Tune runs :func:`runner.job.run`, which imports this module (torch, the engine) in the trial's
process; the driver never imports it. Privacy bookkeeping happens where data is touched: the
attempt is recorded, and charged, through the control plane *before* the trial loads the
dataset (docs/design.md, invariant 2–3).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import ray
import torch
from ray import tune
from safetensors.torch import save_file

from core.plan import proxy_batch_size
from core.shapes import shape_of
from runner.client import AttemptRefused, Progress
from runner.job import JobContext, trial_config, trial_index
from runner.search import random_candidate
from workers.trial import run_trial

log = logging.getLogger("dptune.trial")

#: when this process had imported the trainable, torch and the engine with it: a trial's
#: timings tell a fresh process (just now) from a reused one (a trial ago)
IMPORTED_AT = time.time()


def run_candidate(config: dict[str, Any], ctx: JobContext) -> None:
    """One attempt of trial ``config["trial"]["index"]`` (Tune's trainable: :func:`runner.job.run`).

    Every report to Tune carries the trial's ε (one attempt's, at the job's δ) and, when the
    trial drew its candidate, that candidate as ``params``; the last one adds its DP
    selection score, ``dp_score``. They are Tune's, for the operator's dashboard: what the
    control plane records (and shows analysts) goes through ``api`` alone."""
    entered = time.time()
    index = trial_index(config)
    # as many torch threads as CPUs reserved: more oversubscribe a node shared by trials
    torch.set_num_threads(max(1, math.floor(ctx.spec.resources.cpu)))
    api = ctx.control_plane()
    drawn = "params" not in config["trial"]
    params = random_candidate(ctx.spec.search_space) if drawn else config["trial"]["params"]
    shown = {"epsilon": ctx.plan.trial_epsilon} | ({"params": params} if drawn else {})
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

    progress = Progress(api, attempt)
    reporting = 0.0  # seconds spent reporting progress, in the training loop and after it

    def on_epoch(rows: list[dict[str, Any]]) -> None:
        nonlocal reporting
        started = time.perf_counter()
        # Tune's reports (each waits for the driver) go with the control plane's, as often
        if progress.add(steps_run, [{**r, "public": r["visibility"] == "public"} for r in rows]):
            tune.report({"steps": steps_run, **shown, **{r["name"]: r["value"] for r in rows}})
        reporting += time.perf_counter() - started

    try:
        outcome = run_trial(
            trial_config(ctx, params), on_step=on_step, on_epoch=on_epoch, data_dir=ctx.data_dir
        )
    except BaseException as error:
        with contextlib.suppress(Exception):  # the rows held back, if the control plane answers
            progress.flush()
        api.finish(attempt, "failed", steps_run)
        log.error("trial %d failed: %s", index, error)
        raise
    flushed = time.perf_counter()
    progress.flush()
    reporting += time.perf_counter() - flushed
    result = outcome.result
    # where its start-up and its reporting went, in its Tune results for the operator
    # (bench/job_overhead.py)
    timings = {
        "imported_at": IMPORTED_AT,
        "entered_at": entered,
        "attempt_s": recorded - entered,
        "reporting_s": reporting,
    }
    path = ctx.weights_path(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the initial state with the trained parameters, never the model's own state (invariant 14)
    save_file(outcome.released, str(path))
    api.finish(
        attempt, "succeeded", result["steps"], result["score"]["value"], result["thresholds"]
    )
    tune.report(
        {"steps": result["steps"], **shown, "dp_score": result["score"]["value"]}
        | {"timings": timings | result["timings"]}
    )


def run_on_proxy(config: dict[str, Any], ctx: JobContext) -> None:
    """The Ray Tune trainable of a proxy search: one candidate trained on the job's public
    proxy, as it would train on the private data: its shape's q, T and σ, with the batch
    scaled to the proxy's size (:func:`core.plan.proxy_batch_size`). It reads no
    private data, so nothing is recorded with the control plane, nor charged; its score is
    Tune's, and picks the candidate that then trains on the private data."""
    assert ctx.proxy is not None
    torch.set_num_threads(max(1, math.floor(ctx.spec.resources.cpu)))
    params = config["trial"]["params"]
    cfg = trial_config(ctx, params, ctx.proxy)
    search = ctx.plan.proxy
    if search is not None and search.size is not None:  # the shape's q and T on the proxy
        rate = shape_of(ctx.plan.shapes, params).sample_rate
        cfg = cfg.model_copy(update={"batch_size": proxy_batch_size(rate, search.size)})
    result = run_trial(cfg, data_dir=ctx.data_dir).result
    tune.report({"steps": result["steps"], "dp_score": result["score"]["value"]})
