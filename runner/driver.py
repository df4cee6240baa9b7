"""The tuning-job driver, the entrypoint of a Ray job (``python -m runner <job id>``).

It reads the admitted job from the control plane, decides its trials (:mod:`workers.search`),
runs them with Ray Tune — each under ``tune.with_resources`` with the job's CPU/GPU request —
and finally uploads the best trial's weights by its DP selection score. Each trial is
:func:`runner.trainable.run_candidate`, which records and charges its attempt before it
touches data.
"""

from __future__ import annotations

import argparse
import logging
import sys

import ray
from ray import tune

from core.accounting import tuning_method
from core.config import DatasetConfig
from core.spec import Selection
from runner.client import ControlPlane
from runner.search import Candidate, candidates
from runner.settings import RunnerSettings
from runner.trainable import AttemptRecorder, JobContext, run_candidate
from workers.dp.randomness import SecureStream

log = logging.getLogger("dptune.job")


def _load(job_id: int, settings: RunnerSettings, api: ControlPlane) -> JobContext:
    """Read the job and decide its trials. Under random stopping the job is marked started
    *before* K is drawn, so that its whole bound is charged whatever K turns out to be — even
    K = 0 (invariant 3): the budget must not tell anyone which K was drawn. Its candidates
    are drawn inside the trials (:mod:`workers.search`)."""
    job = api.context()
    spec, plan = job["spec"], job["plan"]
    method = tuning_method(plan["method"])
    cands: list[Candidate] | None = None
    if method.random_stopping:
        api.start()
        k = method.draw_trials(SecureStream().numpy)  # from OS entropy, never a seed
    else:
        cands = candidates(
            spec["search_space"], spec["privacy"].get("trials") or 1, spec["seed"] or 0
        )
        k = len(cands)
    return JobContext(
        job_id,
        settings.control_url,
        settings.job_token.get_secret_value(),
        settings.data_dir.resolve(),
        spec,
        plan,
        DatasetConfig.model_validate(job["dataset"]),
        k,
        cands,
    )


def _tune(ctx: JobContext) -> dict[int, float]:
    """Run the trials; the DP selection scores of those that finished, by trial index."""
    resources = ctx.spec["resources"]
    retries = (
        0
        if tuning_method(ctx.plan["method"]).random_stopping
        else ctx.spec["privacy"]["max_retries"]
    )
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(run_candidate, ctx=ctx),
            {"cpu": resources["cpu"], "gpu": resources["gpu"]},
        ),
        param_space={"index": tune.grid_search(list(range(ctx.trials)))},
        run_config=tune.RunConfig(
            name=f"dptune-job-{ctx.job_id}",
            storage_path=str(ctx.data_dir / "ray_results"),
            failure_config=tune.FailureConfig(max_failures=retries),
            callbacks=[AttemptRecorder(ctx)],
            verbose=1,
        ),
    )
    return {
        int(r.config["index"]): float(r.metrics["score"])
        for r in tuner.fit()
        if r.error is None and r.metrics and r.metrics.get("done")
    }


def _release_best(ctx: JobContext, scores: dict[int, float], api: ControlPlane) -> str:
    """Upload the best finished trial's weights by its DP selection score (invariant 5; the
    control plane checks the choice against the scores it recorded); the other trials'
    weights are deleted (not DP outputs anyone should keep)."""
    if not scores:
        log.warning("no trial finished: nothing to release")
        return "succeeded"
    best = Selection.model_validate(ctx.spec["selection"]).best(scores)
    assert best is not None  # scores is not empty
    api.upload_model(best, ctx.weights_path(best).read_bytes())
    for index in scores:
        ctx.weights_path(index).unlink(missing_ok=True)
    return "released"


def run_job(job_id: int, settings: RunnerSettings) -> str:
    api = ControlPlane(settings.control_url, settings.job_token.get_secret_value(), job_id)
    ctx = _load(job_id, settings, api)
    scores = _tune(ctx) if ctx.trials else {}
    state = _release_best(ctx, scores, api)
    api.end(state)  # the control plane settles the ledger: unused reservation back
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner", description=__doc__.splitlines()[0])
    parser.add_argument("job_id", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    ray.init(address="auto")
    run_job(args.job_id, RunnerSettings())  # type: ignore[call-arg]  # from the environment
    return 0
