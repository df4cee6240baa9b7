"""The tuning-job driver: ``python -m workers.job <job id>``, the entrypoint of a Ray job.

It reads the admitted job from the database, decides its trials (:mod:`workers.search`), runs
them with Ray Tune — each under ``tune.with_resources`` with the job's CPU/GPU request — and
finally releases the best trial's model by its DP selection score. Each trial is
:func:`workers.trainable.run_candidate`, which records and charges its attempt before it
touches data.
"""

from __future__ import annotations

import argparse
import logging
import sys

import ray
from ray import tune
from safetensors.torch import load_file
from sqlalchemy.orm import Session

from service import trials as records
from service.db import Dataset, Job
from service.jobs import apply_state
from service.orchestrator import JobState
from service.settings import Settings
from workers.config import DatasetConfig
from workers.search import Candidate, candidates, draw_trial_count
from workers.trainable import (
    AttemptRecorder,
    JobContext,
    database_engine,
    run_candidate,
    trial_config,
)

log = logging.getLogger("dptune.job")


def _load(job_id: int, settings: Settings) -> JobContext:
    """Read the job and decide its trials. Under random stopping the job is marked started
    *before* K is drawn, so that its whole bound is charged whatever K turns out to be — even
    K = 0 (invariant 3): the budget must not tell anyone which K was drawn. Its candidates
    are drawn inside the trials (:mod:`workers.search`)."""
    with Session(database_engine(settings.sqlalchemy_url)) as session:
        job = session.get(Job, job_id)
        if job is None:
            raise SystemExit(f"job {job_id} does not exist")
        dataset = session.get(Dataset, job.dataset_id)
        spec, plan, accounting = job.spec, job.plan, job.accounting
        cands: list[Candidate] | None = None
        if accounting == "rdp":
            count = spec["privacy"].get("trials") or 1
            cands = candidates(spec["search_space"], count, spec["seed"] or 0)
            k = len(cands)
        else:
            apply_state(session, job_id, JobState.RUNNING)
            k = draw_trial_count(accounting, plan["params"])
        data = DatasetConfig(source=dataset.source, options=dataset.options,
                             num_classes=dataset.num_classes, sha256=dataset.content_sha256)
        return JobContext(job_id, settings.sqlalchemy_url, settings.data_path, spec, plan, data,
                          k, cands)


def _release_best(ctx: JobContext) -> JobState:
    """Release the best finished trial by its DP selection score (invariant 5); the other
    trials' weights are deleted (not DP outputs anyone should keep). The file's metadata holds
    the trial's configuration without its dataset part (the operator's source and options
    are not for analysts)."""
    sign = 1 if ctx.spec["selection"]["mode"] == "max" else -1
    with Session(ctx.engine()) as session:
        job = session.get(Job, ctx.job_id)
        done = {t.index: t for t in job.trials if t.status == "succeeded" and t.score is not None}
        if not done:
            log.warning("no trial finished: nothing to release")
            return JobState.SUCCEEDED
        best = max(done, key=lambda index: sign * done[index].score)
        tensors = {k: v.numpy() for k, v in load_file(str(ctx.weights_path(best))).items()}
        config = trial_config(ctx, done[best].params).model_dump(mode="json",
                                                                 exclude={"dataset"})
        dataset = session.get(Dataset, job.dataset_id)
        public = {"num_classes": dataset.num_classes, "input_shape": dataset.input_shape}
        records.release_model(session, ctx.data_dir, done[best].id, tensors, config, public)
    for index in done:
        ctx.weights_path(index).unlink(missing_ok=True)
    return JobState.RELEASED


def run_job(job_id: int, settings: Settings) -> JobState:
    ctx = _load(job_id, settings)
    resources = ctx.spec["resources"]
    retries = ctx.spec["privacy"].get("max_retries", 0) if ctx.plan["accounting"] == "rdp" else 0
    if ctx.trials:
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(run_candidate, ctx=ctx),
                                {"cpu": resources["cpu"], "gpu": resources["gpu"]}),
            param_space={"index": tune.grid_search(list(range(ctx.trials)))},
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
