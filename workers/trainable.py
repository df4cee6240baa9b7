"""The Ray Tune trainable of a tuning job: one attempt of one trial.

It lives in its own module (not in the driver, which runs as ``__main__``) so that Ray's
workers import it by name. Privacy bookkeeping happens where data is touched: the attempt is
recorded, and charged, by :func:`service.trials.start_attempt` *before* the trial loads the
dataset (DESIGN.md invariants 2–3).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ray import tune
from safetensors.torch import save_file
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from service import trials as records
from service.db import create_db_engine
from service.spec import JobSpec
from workers.config import DatasetConfig, TrialConfig
from workers.search import Candidate
from workers.trial import run_trial

log = logging.getLogger("dptune.trial")

#: test hook: when this file is named and does not exist yet, the next trial attempt creates
#: it and crashes after its first step — so tests can prove that retries are charged.
CRASH_ONCE_ENV = "DPTUNE_CRASH_ONCE_FILE"


class InjectedCrash(RuntimeError):
    pass


@dataclass(frozen=True)
class JobContext:
    """Everything a trial needs, shipped to each trial process by ``tune.with_parameters``."""

    job_id: int
    database_url: str
    data_dir: Path
    spec: dict[str, Any]
    plan: dict[str, Any]
    dataset_source: str
    dataset_options: dict[str, Any]
    candidates: list[Candidate]

    def engine(self) -> Engine:
        return database_engine(self.database_url)

    def weights_path(self, index: int) -> Path:
        return self.data_dir / "jobs" / str(self.job_id) / f"trial-{index}.safetensors"


@functools.lru_cache(maxsize=4)
def database_engine(database_url: str) -> Engine:
    """One engine (and connection pool) per process, however many trials it runs."""
    return create_db_engine(database_url)


def trial_config(ctx: JobContext, index: int) -> TrialConfig:
    """Candidate ``index`` with the job's planned noise. The seed comes from OS entropy: it
    drives Poisson sampling and the DP noise, which must stay secret from the analyst who
    chose the job's seed (that one only fixes the prior over candidates)."""
    dataset = DatasetConfig(source=ctx.dataset_source, options=ctx.dataset_options)
    return JobSpec.model_validate(ctx.spec).trial_config(
        dataset, ctx.plan["noise_multiplier"], ctx.plan["delta"], ctx.candidates[index],
        seed=secrets.randbits(62))


def _maybe_crash() -> None:
    marker = os.environ.get(CRASH_ONCE_ENV)
    if marker and not Path(marker).exists():
        Path(marker).touch()
        raise InjectedCrash(f"injected crash ({CRASH_ONCE_ENV})")


def run_candidate(config: dict[str, Any], ctx: JobContext) -> None:
    """The Ray Tune trainable: one attempt of trial ``config["index"]``."""
    index = int(config["index"])
    # as many torch threads as CPUs reserved: more oversubscribe a node shared by trials
    torch.set_num_threads(max(1, math.floor(ctx.spec["resources"]["cpu"])))
    engine = ctx.engine()
    try:
        with Session(engine) as session:
            # Charged before any data is read; refused when the reservation does not cover
            # it (a cancelled job, retries used up): then the trial ends without touching data.
            attempt_id = records.start_attempt(session, ctx.job_id, index, ctx.candidates[index])
    except records.AttemptRefused as refused:
        log.warning("trial %d not run: %s", index, refused)
        return
    steps_run = 0

    def on_step(t: int, total: int) -> None:
        nonlocal steps_run
        steps_run = t
        if t == 1:
            _maybe_crash()

    def on_epoch(rows: list[dict[str, Any]]) -> None:
        metrics = [{**r, "public": r["visibility"] == "public"} for r in rows]
        with Session(engine) as session:
            records.record_progress(session, attempt_id, steps_run, metrics)
        tune.report({"steps": steps_run, **{r["name"]: r["value"] for r in rows}})

    try:
        outcome = run_trial(trial_config(ctx, index), on_step=on_step, on_epoch=on_epoch,
                            data_dir=ctx.data_dir)
    except BaseException as error:
        with Session(engine) as session:
            records.finish_attempt(session, attempt_id, "failed", steps_run)
        log.error("trial %d failed: %s", index, error)
        raise
    result = outcome.result
    path = ctx.weights_path(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in outcome.model.state_dict().items()},
              str(path))
    with Session(engine) as session:
        records.finish_attempt(session, attempt_id, "succeeded", result["steps"],
                               result["score"]["value"], result["thresholds"])
    tune.report({"steps": result["steps"], "score": result["score"]["value"], "done": True})


class AttemptRecorder(tune.Callback):
    """Tune callback on the driver: when a trial's process dies without reporting (killed,
    out of memory), the attempt it had started is marked failed — it stays charged."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        with Session(self.ctx.engine()) as session:
            records.fail_open_attempts(session, self.ctx.job_id, int(trial.config["index"]))
