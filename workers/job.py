"""The tuning-job driver: ``python -m workers.job <job id>``, the entrypoint of a Ray job.

It reads the admitted job from the database, decides its trials (:mod:`workers.search`), runs
them with Ray Tune — each under ``tune.with_resources`` with the job's CPU/GPU request — and
finally releases the best trial's model by its DP selection score. Privacy bookkeeping happens
where data is touched: a trial attempt is recorded, and charged, by
:func:`service.trials.start_attempt` *before* it loads the dataset (DESIGN.md invariants 2–3).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune
from safetensors.torch import load_file, save_file
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from service import trials as records
from service.db import Dataset, Job, create_db_engine
from service.jobs import apply_state
from service.orchestrator import JobState
from service.settings import Settings
from service.spec import JobSpec
from workers.config import DatasetConfig, TrialConfig
from workers.search import Candidate, candidates, draw_trial_count
from workers.trial import run_trial

log = logging.getLogger("dptune.job")

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
        return _engine(self.database_url)

    def weights_path(self, index: int) -> Path:
        return self.data_dir / "jobs" / str(self.job_id) / f"trial-{index}.safetensors"


@functools.lru_cache(maxsize=4)
def _engine(database_url: str) -> Engine:
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


def _load(job_id: int, settings: Settings) -> JobContext:
    """Read the job and decide its trials. Under random stopping the job is marked started
    *before* K is drawn, so that its whole bound is charged whatever K turns out to be — even
    K = 0 (invariant 3): the budget must not tell anyone which K was drawn."""
    with Session(_engine(settings.sqlalchemy_url)) as session:
        job = session.get(Job, job_id)
        if job is None:
            raise SystemExit(f"job {job_id} does not exist")
        dataset = session.get(Dataset, job.dataset_id)
        spec, plan, accounting = job.spec, job.plan, job.accounting
        if accounting == "rdp":
            count = spec["privacy"].get("trials") or 1
            cands = candidates(spec["search_space"], count, spec["seed"])
        else:
            apply_state(session, job_id, JobState.RUNNING)
            k = draw_trial_count(accounting, plan["params"])
            cands = candidates(spec["search_space"], k, spec["seed"]) if k else []
        return JobContext(job_id, settings.sqlalchemy_url, settings.data_path, spec, plan,
                          dataset.source, dataset.options, cands)


def _release_best(ctx: JobContext) -> JobState:
    """Release the best finished trial by its DP selection score (invariant 5); the other
    trials' weights are deleted (not DP outputs anyone should keep)."""
    sign = 1 if ctx.spec["selection"]["mode"] == "max" else -1
    with Session(ctx.engine()) as session:
        job = session.get(Job, ctx.job_id)
        done = {t.index: (t.id, t.score) for t in job.trials
                if t.status == "succeeded" and t.score is not None}
        if not done:
            log.warning("no trial finished: nothing to release")
            return JobState.SUCCEEDED
        best = max(done, key=lambda index: sign * done[index][1])
        tensors = {k: v.numpy() for k, v in load_file(str(ctx.weights_path(best))).items()}
        config = trial_config(ctx, best).model_dump(mode="json", exclude={"seed"})
        records.release_model(session, ctx.data_dir, done[best][0], tensors, config)
    for index in done:
        ctx.weights_path(index).unlink(missing_ok=True)
    return JobState.RELEASED


def run_job(job_id: int, settings: Settings) -> JobState:
    ctx = _load(job_id, settings)
    resources = ctx.spec["resources"]
    retries = ctx.spec["privacy"].get("max_retries", 0) if ctx.plan["accounting"] == "rdp" else 0
    if ctx.candidates:
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(run_candidate, ctx=ctx),
                                {"cpu": resources["cpu"], "gpu": resources["gpu"]}),
            param_space={"index": tune.grid_search(list(range(len(ctx.candidates))))},
            run_config=tune.RunConfig(
                name=f"dptune-job-{job_id}",
                storage_path=str(ctx.data_dir / "ray_results"),
                failure_config=tune.FailureConfig(max_failures=retries),
                callbacks=[AttemptRecorder(ctx)],
                verbose=1,
            ),
        )
        tuner.fit()
    state = _release_best(ctx)
    with Session(ctx.engine()) as session:
        apply_state(session, job_id, state)  # settles the ledger: unused reservation back
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job_id", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    ray.init(address="auto")
    run_job(args.job_id, Settings())
    return 0


if __name__ == "__main__":
    sys.exit(main())
