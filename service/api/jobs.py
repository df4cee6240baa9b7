"""Tuning jobs: admission, state, trials, cancel, model. What a caller sees of a job is decided
by :mod:`service.visibility` (docs/design.md, invariant 4 and 11)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import FileResponse
from sqlalchemy import select

from core import accounting
from core.spec import JobSpec
from core.views import JobOut, TrialOut
from service import admission, lifecycle, reporting, visibility
from service.api.deps import (
    Caller,
    Id,
    OrchestratorDep,
    SessionDep,
    SettingsDep,
    job_dataset,
    visible_job,
)
from service.api.errors import COMMON, field_error, responses
from service.api.listing import COUNTED, JobsQuery, page, page_of
from service.api.shedding import RESPONSES as SHED
from service.auth import Principal
from service.db import Job
from service.orchestration import Inspectable, JobState, Orchestrator, OrchestratorUnavailable
from service.own_models import plan_with_model

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=COMMON)


class ModelFile(FileResponse):
    """The released weights without ``Last-Modified`` and a time-based ``ETag``: the file was
    written when the job ended, a time that under random stopping depends on K (invariant
    11). Its ETag is its SHA-256."""

    def set_stat_headers(self, stat_result: os.stat_result) -> None:
        self.headers.setdefault("content-length", str(stat_result.st_size))


UNSUBMITTED = (
    "waiting for the Ray cluster, which does not answer: the job is handed to it when it "
    "does; its reservation is held"
)
NEVER_STARTED = "failed before it started: no trial ran (an operator can see why)"
CANCELLED = "cancelled"


def reason(job: Job, caller: Principal, status: str, said: str | None = None) -> str | None:
    """Why the job is ``status`` (as the caller sees it). An analyst gets only reasons that
    are settled before the job starts — so before any data is read or K drawn — and depend
    on no private data (invariants 4 and 11): :data:`UNSUBMITTED`, :data:`NEVER_STARTED`,
    :data:`CANCELLED`; nothing for a job that started. An operator gets the recorded error,
    else ``said`` (what the cluster says of the job), else why no trial has started yet."""
    if caller.is_operator and status != JobState.RELEASED:
        if job.error or said:
            return job.error or said
        if status == JobState.RUNNING and not job.trials:
            cpu, gpu = job.spec["resources"]["cpu"], job.spec["resources"]["gpu"]
            return (
                f"no trial has started yet: each waits for {cpu:g} CPUs and {gpu:g} GPUs free "
                "on one node (the job's log says what Ray Tune waits for)"
            )
    if status == JobState.CANCELLED:
        return CANCELLED
    if status == JobState.QUEUED and job.submitted_at is None:
        return UNSUBMITTED
    if status == JobState.FAILED and job.started_at is None:
        return NEVER_STARTED
    return None


def job_out(
    job: Job, caller: Principal, dashboard_url: str | None = None, said: str | None = None
) -> JobOut:
    """``said``: what the cluster says of the job, for operators (:func:`cluster_message`)."""
    view = visibility.job_view(job, caller, dashboard_url)
    return JobOut(
        id=job.id,
        dataset=job.dataset_id,
        accounting=job.accounting,
        plan=job.plan,
        spec=job.spec,
        created_at=job.created_at,
        reason=reason(job, caller, view.status, said),
        **asdict(view),
    )


def cluster_message(orchestrator: Orchestrator, job: Job) -> str | None:
    """What the cluster says of a submitted job that waits or failed (Ray: why its job is
    pending, or how its entrypoint failed, quoting its log), or None when it says nothing or
    does not answer. For operators only: it may quote the job's output."""
    waits_or_failed = job.status in (JobState.QUEUED, JobState.FAILED)
    if not (waits_or_failed and job.submitted_at and isinstance(orchestrator, Inspectable)):
        return None
    try:
        return orchestrator.message(job.id)
    except OrchestratorUnavailable:
        return None


def visible_trials(job: Job, caller: Principal) -> list[TrialOut]:
    return [
        TrialOut.model_validate(t, from_attributes=True) for t in visibility.trials(job, caller)
    ]


@router.post("", status_code=status.HTTP_202_ACCEPTED, responses=responses(404, 409) | SHED)
def submit(
    spec: JobSpec,
    session: SessionDep,
    caller: Caller,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobOut:
    """Plan the job and reserve its full cost in one transaction (409 when it does not fit;
    nothing is reserved). A repeated ``Idempotency-Key`` returns the first job. 422 on
    ``resources.cpu`` (or ``.gpu``) when no node of the cluster could ever run one of its
    trials (:mod:`service.admission`; unchecked while the cluster does not answer)."""
    dataset = job_dataset(session, caller, spec)
    planned = plan_with_model(spec, dataset, session, settings)
    if settings.ray_check_resources:
        admission.check(spec.resources, orchestrator)
    try:
        job, new = lifecycle.admit(session, caller, spec, planned, idempotency_key)
    except lifecycle.BudgetExceeded as error:
        raise field_error(error.field, str(error), status.HTTP_409_CONFLICT) from None
    except lifecycle.IdempotencyConflict as error:
        raise field_error("Idempotency-Key", str(error), status.HTTP_409_CONFLICT) from None
    except lifecycle.DatasetGone as error:
        raise field_error("dataset", str(error), status.HTTP_404_NOT_FOUND) from None
    if new:
        lifecycle.submit(session, orchestrator, job.id)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    return job_out(job, caller)


@router.get("", responses=COUNTED)
def list_jobs(
    session: SessionDep,
    caller: Caller,
    params: Annotated[JobsQuery, Query()],
    response: Response,
) -> list[JobOut]:
    """The caller's jobs, newest first. ``status`` filters on the status the caller sees
    (:func:`service.visibility.job_view`): an analyst's filter on the status of a random-
    stopping job tells no more than reading the job does (invariant 11)."""
    query = select(Job).order_by(Job.id.desc())
    if not caller.is_operator:
        query = query.where(
            Job.owner_key_id == caller.key_id, Job.dataset_id.in_(caller.dataset_ids)
        )
    if params.dataset is not None:
        query = query.where(Job.dataset_id == params.dataset)
    if params.status is None or caller.is_operator:
        if params.status is not None:
            query = query.where(Job.status == params.status)
        return [job_out(j, caller) for j in page(session, response, query, params)]
    hidden = Job.accounting.in_(accounting.RANDOM_STOPPING)  # the status shown is not stored
    candidates = session.execute(query.where(hidden | (Job.status == params.status))).scalars()
    shown = [j for j in candidates if visibility.job_view(j, caller).status == params.status]
    return [job_out(j, caller) for j in page_of(response, shown, params)]


@router.get("/{job_id}", responses=responses(404))
def get_job(
    job_id: Id, session: SessionDep, caller: Caller, orchestrator: OrchestratorDep
) -> JobOut:
    """The job as the caller sees it, its state asked of the orchestrator first — except for
    an analyst of a random-stopping job, whose read does the same work whether the job runs
    or has ended (:func:`service.visibility.asks_orchestrator`; invariant 11)."""
    job = visible_job(session, caller, job_id)
    if visibility.asks_orchestrator(job, caller):
        lifecycle.refresh(session, orchestrator, job_id)
    said = cluster_message(orchestrator, job) if caller.is_operator else None
    return job_out(job, caller, orchestrator.dashboard_url, said)


@router.get("/{job_id}/trials", responses=responses(404))
def get_trials(job_id: Id, session: SessionDep, caller: Caller) -> list[TrialOut]:
    return visible_trials(visible_job(session, caller, job_id), caller)


@router.get(
    "/{job_id}/report.png",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}}} | responses(404),
)
def get_report(job_id: Id, session: SessionDep, caller: Caller) -> Response:
    """The job's trials and its dataset's budget as a PNG, drawn from what the JSON views
    show the caller (:mod:`service.reporting`)."""
    job = visible_job(session, caller, job_id)
    png = reporting.render(reporting.collect(session, job, caller))
    return Response(png, media_type="image/png")


@router.post(
    "/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, responses=responses(404, 409, 503)
)
def cancel(
    job_id: Id, session: SessionDep, caller: Caller, orchestrator: OrchestratorDep
) -> JobOut:
    """Ask the job to stop. Privacy already consumed is not refunded (invariant 3); the
    reservation of what never ran is released once the job has stopped. 409 for an analyst's
    started job that holds its release (:func:`service.visibility.cancel_refusal`); 503 when
    the job runs on a cluster that does not answer (try again)."""
    job = visible_job(session, caller, job_id)
    refusal = visibility.cancel_refusal(job, caller)
    if refusal is not None:
        raise field_error("job", refusal, status.HTTP_409_CONFLICT)
    try:
        lifecycle.cancel(session, orchestrator, job_id)
    except OrchestratorUnavailable as error:
        raise field_error("job", f"cannot stop it now: {error}", 503) from None
    return job_out(session.get(Job, job_id), caller)


@router.get(
    "/{job_id}/model",
    response_class=ModelFile,
    responses={200: {"content": {"application/octet-stream": {}}}} | responses(404, 409),
)
def get_model(job_id: Id, session: SessionDep, caller: Caller, settings: SettingsDep) -> Any:
    """The released weights as safetensors; the trial config is in the file's metadata
    (``config``). 409 until a model is released."""
    job = visible_job(session, caller, job_id)
    view = visibility.job_view(job, caller)
    if not view.released:
        raise field_error(
            "job",
            f"job {job_id} has no released model (status {view.status})",
            status.HTTP_409_CONFLICT,
        )
    path = (settings.data_path / job.artifact.path).resolve()
    if not path.is_relative_to(settings.data_path):
        raise RuntimeError(f"artifact path {job.artifact.path!r} escapes DATA_DIR")
    sha256 = job.artifact.sha256
    return ModelFile(
        path,
        media_type="application/octet-stream",
        filename=f"job-{job_id}.safetensors",
        headers={"X-Dptune-Sha256": sha256, "ETag": f'"{sha256}"'},
    )
