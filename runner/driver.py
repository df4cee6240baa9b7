"""The tuning-job driver, the entrypoint of a Ray job (``python -m runner <job id>``).

It reads the admitted job from the control plane, decides its trials (:mod:`runner.search`),
runs them with Ray Tune — each under ``tune.with_resources`` with the job's CPU/GPU request —
and finally uploads the best trial's weights by its DP selection score. Each trial is
:func:`runner.trainable.run_candidate`, which records and charges its attempt before it
touches data. Its log, which the Ray dashboard shows operators, has Tune's table of trials
with their hyperparameters, DP scores and ε, and ends with the job's summary
(:mod:`runner.summary`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from dataclasses import replace
from typing import Any

import ray
from ray import tune
from ray.tune import CLIReporter
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

from core.config import DatasetConfig
from core.entropy import secure_generator
from core.plan import Plan
from core.spec import LEVEL, JobSpec
from runner import summary
from runner.client import ControlPlane
from runner.job import AttemptRecorder, JobContext, param_space, run, shown_paths
from runner.search import Candidate, candidates, final_candidate, scaling_candidates
from runner.settings import RunnerSettings
from runner.summary import TrialLog, TrialRow, keep_alignment

log = logging.getLogger("dptune.job")


def _load(
    job_id: int,
    settings: RunnerSettings,
    api: ControlPlane,
    job: dict[str, Any],
    spec: JobSpec,
    plan: Plan,
) -> JobContext:
    """Decide the job's trials (``job``: its context as read, ``spec`` and ``plan`` its
    parts, typed). Under random stopping the job is marked started *before* K is drawn, so
    that its whole bound is charged whatever K turns out to be — even K = 0 (invariant 3): the
    budget must not tell anyone which K was drawn. Its candidates are drawn inside the trials
    (:mod:`runner.search`)."""
    cands: list[Candidate] | None = None
    if plan.method.random_stopping:
        api.start()
        k = plan.method.draw_trials(secure_generator())  # from OS entropy, never a seed
    elif plan.scaling is not None:  # the cheap runs; the final one follows (:func:`_scale`)
        cands = scaling_candidates(spec, plan)
        k = len(cands)
    else:
        cands = candidates(spec.search_space, spec.privacy.trials or 1, spec.seed or 0)
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
        None if job.get("proxy") is None else DatasetConfig.model_validate(job["proxy"]),
    )


class DashboardReporter(CLIReporter):
    """Tune's command-line reporter, with its tables kept aligned in the Ray dashboard's log
    viewer (:func:`runner.summary.keep_alignment`)."""

    def report(self, trials: list[Any], done: bool, *sys_info: str) -> None:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            super().report(trials, done, *sys_info)
        print(keep_alignment(text.getvalue()), end="", flush=True)


def progress_reporter(ctx: JobContext) -> CLIReporter:
    """Tune's progress table in the job's log (the Ray dashboard shows it): each trial's
    hyperparameters — from its config (fixed K) or as the trial reported them once drawn
    (random stopping, :func:`runner.trainable.run_candidate`) — its steps, DP score and ε.
    Printed every 30 s while trials run, and once at the end."""
    paths = shown_paths(ctx.spec)
    drawn = ctx.candidates is None
    return DashboardReporter(
        parameter_columns={"trial/index": "trial"}
        | ({} if drawn else {f"trial/params/{p}": p for p in paths}),
        metric_columns=({f"params/{p}": p for p in paths} if drawn else {})
        | {"steps": "steps", "dp_score": "DP score", "epsilon": "ε"},
        max_column_length=24,  # the longest searchable path, optimizer.weight_decay, whole
        max_report_frequency=30,
        metric="dp_score",
        mode=ctx.spec.selection.mode,
    )


def _tune(ctx: JobContext, reuse: bool, proxy: bool = False) -> list[TrialRow]:
    """Run the trials; each one's row of the job's closing table, by trial index. With
    ``reuse`` a trial process that ends well runs the job's next trial (Tune's actor reuse:
    torch imported and the dataset read once per process, :func:`workers.data.load_cached`);
    one whose trial failed or died is replaced, so a retry starts in a fresh process. With
    ``proxy`` the candidates train on the job's public proxy instead (:func:`_search_proxy`)."""
    resources = ctx.spec.resources
    retries = 0 if proxy or ctx.plan.method.random_stopping else ctx.spec.privacy.max_retries
    # Tune's default reporter ignores ``progress_reporter`` and picks its columns itself (the
    # first four metrics reported); this switch selects the reporter that shows those asked for
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Tune adds a TensorBoard logger unless told not to, and tensorboardX imports torch, a slow
    # import in every job's start before its first trial process is asked for. Nothing reads its
    # event files; the JSON and CSV results (each trial's ``result.json``) are kept.
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    loggers = [JsonLoggerCallback(), CSVLoggerCallback()]
    trials = TrialLog()
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(run, ctx=ctx, proxy=proxy),
            {"cpu": resources.cpu, "gpu": resources.gpu},
        ),
        param_space=param_space(ctx),
        tune_config=tune_config(ctx, reuse, proxy),
        run_config=tune.RunConfig(
            name=f"dptune-job-{ctx.job_id}" + ("-proxy" if proxy else "-final" * bool(ctx.first)),
            storage_path=str(ctx.data_dir / "ray_results"),
            failure_config=tune.FailureConfig(max_failures=retries),
            callbacks=[*loggers, trials] if proxy else [*loggers, AttemptRecorder(ctx), trials],
            progress_reporter=progress_reporter(ctx),
            verbose=1,
        ),
    )
    tuner.fit()
    return trials.rows


def tune_config(ctx: JobContext, reuse: bool, proxy: bool = False) -> tune.TuneConfig:
    """How Tune schedules the trials. A job that holds its release runs them one at a time
    in one reused process, whose last trial waits for the hold's end (:func:`runner.job.hold`):
    from its first trial to the hold's end it then keeps one trial's CPUs and GPUs whatever
    K, as the hold times its trials, run one after another (:func:`core.hold.hold_until`).
    Run side by side, K trials would take K trials' resources, and free them when K is
    reached: another job's start and attempt times would tell K (invariant 11)."""
    if ctx.holds_release and not proxy:
        return tune.TuneConfig(reuse_actors=True, max_concurrent_trials=1)
    return tune.TuneConfig(reuse_actors=reuse)


def _search_proxy(ctx: JobContext, reuse: bool) -> JobContext:
    """Search on the job's public proxy: every candidate trains there (free: no private data
    is read), and the job goes on with the best by its score there as its one trial on the
    private data — chosen from public data alone, so it costs nothing either (paper 001's
    setting of tuning on public data; ``docs/design.md``, invariant 5). No candidate
    finishing leaves nothing to train privately."""
    rows = _tune(ctx, reuse, proxy=True)
    scores = {r.index: r.score for r in rows if r.score is not None}
    best = ctx.spec.selection.best(scores)
    log.info(
        "proxy search: %d of %d candidates finished; best %s",
        len(scores),
        ctx.trials,
        "none" if best is None else f"{ctx.candidates[best]} (score {scores[best]:.4g})",
    )
    chosen = [] if best is None else [ctx.candidates[best]]
    return replace(ctx, trials=len(chosen), candidates=chosen)


def _scale(ctx: JobContext, reuse: bool) -> tuple[JobContext, list[TrialRow]]:
    """A scaling job: its cheap runs, then the final run at the learning rate the line fitted
    through their best scores gives (:func:`runner.search.final_candidate`) — chosen from
    their released DP scores alone, so it costs nothing beyond the runs. No cheap run
    finishing leaves no final run."""
    rows = _tune(ctx, reuse)
    finished = [(r.params, r.score) for r in rows if r.score is not None]
    final = final_candidate(ctx.spec, ctx.plan, finished)
    if final is None:
        log.warning("scaling: no cheap run finished: no final run")
        return ctx, rows
    log.info("scaling: final run %s", final)
    assert ctx.candidates is not None
    ctx = replace(ctx, trials=ctx.trials + 1, candidates=[*ctx.candidates, final], first=ctx.trials)
    return ctx, rows + _tune(ctx, reuse)


def _release_best(ctx: JobContext, scores: dict[int, float], api: ControlPlane) -> int | None:
    """Upload the best finished trial's weights by its DP selection score (invariant 5; the
    control plane checks the choice against the scores it recorded) — of a scaling job, its
    final run's — and return its index; the other trials' weights are deleted (not DP outputs
    anyone should keep)."""
    best = ctx.spec.selection.best(_releasable(ctx, scores))
    if best is None:
        log.warning("no trial finished: nothing to release")
        return None
    api.upload_model(best, ctx.weights_path(best).read_bytes())
    for index in scores:
        ctx.weights_path(index).unlink(missing_ok=True)
    return best


def _releasable(ctx: JobContext, scores: dict[int, float]) -> dict[int, float]:
    """The finished trials that may be released: every one, or a scaling job's final run."""
    scaling = ctx.plan.scaling
    if scaling is None or ctx.candidates is None:
        return scores
    final = len(scaling.levels)
    return {i: s for i, s in scores.items() if ctx.candidates[i].get(LEVEL) == final}


def model_refusal(spec: JobSpec, plan: Plan) -> str | None:
    """Why the job's imported model must not train on these workers, if it must not. The
    control plane inspected it at admission (its report is ``plan.model``); the package here
    may differ, so it is inspected again before any trial, without data. Only then does the
    driver import torch and the engine (:mod:`runner.job`: a job's start waits for them)."""
    planned = plan.model
    if planned is None:  # a built-in model
        return None
    from workers.models import build_model, inspect_model  # torch: for imported models only

    shape, classes = tuple(planned.input_shape), planned.num_classes
    try:
        model = build_model(spec.model, shape, classes)
    except ValueError as error:
        return str(error)
    report = inspect_model(model, shape, classes, spec.method.per_sample)
    if report.refused:
        return f"model.name: DP-SGD cannot train this model: {report.reason}"
    if planned.state is not None and report.state != planned.state:  # its upload is refused
        return "model.name: the model built here holds other tensors than the one admitted"
    return None


def run_job(job_id: int, settings: RunnerSettings) -> str:
    api = ControlPlane(settings.control_url, settings.job_token.get_secret_value(), job_id)
    job = api.context()
    spec, plan = JobSpec.model_validate(job["spec"]), Plan.model_validate(job["plan"])
    refusal = model_refusal(spec, plan)  # before the job starts or records an attempt
    if refusal is not None:
        log.error("job %d: %s", job_id, refusal)
        api.end("failed", refusal[:2000])  # the longest error the control plane records
        return "failed"
    ctx = _load(job_id, settings, api, job, spec, plan)
    if ctx.proxy is not None:
        api.start()  # running while it searches: nothing is charged before a private trial
        ctx = _search_proxy(ctx, settings.reuse_processes)
    if ctx.plan.scaling is not None:
        ctx, rows = _scale(ctx, settings.reuse_processes)
    else:
        rows = _tune(ctx, settings.reuse_processes) if ctx.trials else []
    best = _release_best(ctx, {r.index: r.score for r in rows if r.score is not None}, api)
    state = "succeeded" if best is None else "released"
    charged = api.end(state)  # the control plane settles the ledger: unused reservation back
    summary.show(ctx, rows, best, charged)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner", description=__doc__.splitlines()[0])
    parser.add_argument("job_id", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    ray.init(address="auto")
    run_job(args.job_id, RunnerSettings())  # type: ignore[call-arg]  # from the environment
    return 0
