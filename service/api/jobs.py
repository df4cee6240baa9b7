"""Tuning jobs: admission, state, trials (filtered by DESIGN.md invariant 4), cancel, model."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import FileResponse
from pydantic import BaseModel
from sqlalchemy import select

from service import accounting, jobs, ledger
from service.api.deps import (
    Caller,
    OrchestratorDep,
    SessionDep,
    SettingsDep,
    visible_dataset,
    visible_job,
)
from service.api.errors import field_error
from service.auth import Principal
from service.db import Job, Trial
from service.planning import plan_job
from service.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class Progress(BaseModel):
    """How far a job is. Under random stopping (lt, ps) analysts see ``"random"`` totals and
    no count of trials done: the number of trials is not a DP output (invariant 4)."""

    trials_done: int | None
    trials_total: int | Literal["random"]
    best_score: float | None  # best DP selection score visible to the caller so far


class JobOut(BaseModel):
    id: int
    dataset: int
    status: str
    accounting: str
    plan: dict[str, Any]
    spec: dict[str, Any]
    released: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None = None  # operator only: may quote private data
    progress: Progress
    dashboard_url: str | None = None  # operator only


class TrialOut(BaseModel):
    """Fields that are ``null`` are withheld from analysts (not DP outputs)."""

    index: int | None
    params: dict[str, Any]
    score: float | None
    metrics: list[dict[str, Any]]
    thresholds: list[float] | None  # per-step thresholds of an adaptive rule (DP outputs)
    released: bool
    status: str | None = None
    steps: int | None = None
    attempts: list[dict[str, Any]] | None = None
    epsilon: float | None = None  # what this trial's attempts cost, at the dataset's δ


def _shown_trials(job: Job, caller: Principal) -> list[Trial]:
    """Invariant 4: under random stopping (lt, ps) analysts see only the released trial."""
    if caller.is_operator or job.accounting == "rdp":
        return job.trials
    released = job.artifact.trial_id if job.artifact else None
    return [t for t in job.trials if t.id == released]


def progress(job: Job, caller: Principal) -> Progress:
    scores = [t.score for t in _shown_trials(job, caller) if t.score is not None]
    best = (max if job.spec["selection"]["mode"] == "max" else min)(scores) if scores else None
    fixed = job.accounting == "rdp"
    done = sum(t.status in ("succeeded", "failed") for t in job.trials)
    return Progress(
        trials_done=done if fixed or caller.is_operator else None,
        trials_total=job.plan["trials"]["max"] if fixed else "random",
        best_score=best,
    )


def job_out(job: Job, caller: Principal, dashboard_url: str | None = None) -> JobOut:
    return JobOut(
        id=job.id, dataset=job.dataset_id, status=job.status, accounting=job.accounting,
        plan=job.plan, spec=job.spec, released=job.artifact is not None,
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        error=job.error if caller.is_operator else None, progress=progress(job, caller),
        dashboard_url=dashboard_url if caller.is_operator else None,
    )


def visible_trials(job: Job, caller: Principal) -> list[TrialOut]:
    """Invariant 4. Operators see everything. Analysts see DP outputs only — parameters, the
    DP selection score, metrics marked public — and under random stopping (lt, ps) only the
    released trial, without its index (the number of trials run is not a DP output)."""
    released = job.artifact.trial_id if job.artifact else None
    if caller.is_operator:
        curve = ledger.trial_rdp(job) if job.trials else None

        def epsilon(attempts: int) -> float | None:
            """What a trial's attempts cost on their own (the job's charge is the ledger's)."""
            if not attempts:
                return None
            return accounting.epsilon_from_rdp(attempts * curve, job.plan["delta"])[0]

        return [
            TrialOut(
                index=t.index, params=t.params, score=t.score, metrics=t.metrics,
                thresholds=t.thresholds, released=t.id == released, status=t.status,
                steps=t.steps, epsilon=epsilon(len(t.attempts)),
                attempts=[{"number": a.number, "status": a.status, "steps": a.steps,
                           "started_at": a.started_at.isoformat(),
                           "ended_at": a.ended_at.isoformat() if a.ended_at else None}
                          for a in t.attempts],
            )
            for t in job.trials
        ]
    return [
        TrialOut(
            index=t.index if job.accounting == "rdp" else None, params=t.params, score=t.score,
            metrics=[m for m in t.metrics if m.get("public") is True], thresholds=t.thresholds,
            released=t.id == released,
        )
        for t in _shown_trials(job, caller)
    ]


@router.post("", status_code=status.HTTP_202_ACCEPTED)
def submit(
    spec: JobSpec,
    session: SessionDep,
    caller: Caller,
    orchestrator: OrchestratorDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobOut:
    """Plan the job and reserve its full cost in one transaction (409 when it does not fit;
    nothing is reserved). A repeated ``Idempotency-Key`` returns the first job."""
    dataset = visible_dataset(session, caller, spec.dataset)
    planned = plan_job(spec, dataset)
    try:
        job, new = jobs.admit(session, caller, spec, planned, idempotency_key)
    except jobs.BudgetExceeded as error:
        raise field_error(error.field, str(error), status.HTTP_409_CONFLICT) from None
    except jobs.IdempotencyConflict as error:
        raise field_error("Idempotency-Key", str(error), status.HTTP_409_CONFLICT) from None
    if new:
        jobs.submit(session, orchestrator, job, dataset)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    return job_out(job, caller)


@router.get("")
def list_jobs(
    session: SessionDep,
    caller: Caller,
    dataset: int | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[JobOut]:
    query = select(Job).order_by(Job.id.desc())
    if not caller.is_operator:
        query = query.where(Job.owner_key_id == caller.key_id,
                            Job.dataset_id.in_(caller.dataset_ids))
    if dataset is not None:
        query = query.where(Job.dataset_id == dataset)
    return [job_out(j, caller) for j in session.execute(query.limit(limit).offset(offset))
            .scalars()]


@router.get("/{job_id}")
def get_job(
    job_id: int, session: SessionDep, caller: Caller, orchestrator: OrchestratorDep
) -> JobOut:
    job = visible_job(session, caller, job_id)
    jobs.refresh(session, orchestrator, job)
    return job_out(session.get(Job, job_id), caller, orchestrator.dashboard_url)


@router.get("/{job_id}/trials")
def get_trials(job_id: int, session: SessionDep, caller: Caller) -> list[TrialOut]:
    return visible_trials(visible_job(session, caller, job_id), caller)


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED)
def cancel(
    job_id: int, session: SessionDep, caller: Caller, orchestrator: OrchestratorDep
) -> JobOut:
    """Ask the job to stop. Privacy already consumed is not refunded (invariant 3); the
    reservation of what never ran is released once the job has stopped."""
    job = visible_job(session, caller, job_id)
    orchestrator.cancel(job.id)
    jobs.refresh(session, orchestrator, job)
    return job_out(session.get(Job, job_id), caller)


@router.get(
    "/{job_id}/model",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def get_model(job_id: int, session: SessionDep, caller: Caller, settings: SettingsDep) -> Any:
    """The released weights as safetensors; the trial config is in the file's metadata
    (``config``). 409 until a model is released."""
    job = visible_job(session, caller, job_id)
    if job.artifact is None:
        raise field_error("job", f"job {job_id} has no released model (status {job.status})",
                          status.HTTP_409_CONFLICT)
    path = (settings.data_path / job.artifact.path).resolve()
    if not path.is_relative_to(settings.data_path):
        raise RuntimeError(f"artifact path {job.artifact.path!r} escapes DATA_DIR")
    return FileResponse(path, media_type="application/octet-stream",
                        filename=f"job-{job_id}.safetensors",
                        headers={"X-Dptune-Sha256": job.artifact.sha256})
