"""A job's life in the control plane: admission (plan + reservation in one locked
transaction), state changes reported by the orchestrator, and settlement of its ledger."""

from __future__ import annotations

import hashlib
import math
import secrets
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.spec import JobSpec
from service import ledger
from service.auth import Principal, digest
from service.db import Dataset, Job, begin_write, locked_dataset
from service.orchestration import JobState, Orchestrator, Submission
from service.planning import PlannedJob


class BudgetExceeded(Exception):
    """The job does not fit; ``field`` is the spec field to change."""

    def __init__(self, budget: ledger.Budget, job_epsilon: float) -> None:
        if math.isinf(budget.committed):
            self.field = "privacy.delta"
            message = (
                f"the job does not fit: the δs charged by basic composition (Liu–Talwar jobs, "
                f"caps on K) would use up the dataset's δ {budget.delta:g}; ask for a smaller δ"
            )
        else:
            self.field = "privacy.epsilon"
            message = (
                f"the job (ε = {job_epsilon:.4g}) does not fit: the dataset's committed ε would "
                f"be {budget.committed:.4g}, over its budget {budget.epsilon:.4g} by "
                f"{budget.committed - budget.epsilon:.4g}"
            )
        super().__init__(message)


class IdempotencyConflict(Exception):
    pass


def request_sha256(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def admit(
    session: Session,
    principal: Principal,
    spec: JobSpec,
    planned: PlannedJob,
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """Reserve the job's full planned cost and create it, in one transaction holding the
    dataset's budget lock (docs/design.md, invariant 2). Returns the job and whether it is new: a
    request repeating an earlier ``idempotency_key`` of the same caller gets that job back and
    reserves nothing. Raises :class:`BudgetExceeded` (nothing reserved) when it does not fit.
    """
    digest = request_sha256(spec)
    try:
        dataset = locked_dataset(session, spec.dataset)
        assert dataset is not None  # checked by the caller; datasets are never deleted
        if idempotency_key is not None:
            earlier = session.execute(
                select(Job).where(
                    Job.owner_key_id == principal.key_id, Job.idempotency_key == idempotency_key
                )
            ).scalar_one_or_none()
            if earlier is not None:
                if earlier.request_sha256 != digest:
                    raise IdempotencyConflict(
                        "Idempotency-Key was already used for a different job spec"
                    )
                session.commit()
                return earlier, False
        vec = ledger.amount(planned.reservation)
        after = ledger.budget(session, dataset, plus=vec)
        if after.committed > dataset.epsilon:
            raise BudgetExceeded(after, planned.plan.epsilon)
        job = Job(
            dataset_id=dataset.id,
            owner_key_id=principal.key_id,
            idempotency_key=idempotency_key,
            request_sha256=digest,
            spec=spec.model_dump(mode="json"),
            plan=planned.plan.model_dump(mode="json"),
            accounting=spec.privacy.accounting,
            status=JobState.QUEUED,
        )
        session.add(job)
        session.flush()
        ledger.append(
            session,
            job,
            "reservation",
            f"job:{job.id}:reservation",
            vec,
            f"{spec.privacy.accounting} job, planned ε = {planned.plan.epsilon:.4g}",
        )
        session.commit()
        return job, True
    except BaseException:
        session.rollback()
        raise


def submit(session: Session, orchestrator: Orchestrator, job: Job, dataset: Dataset) -> None:
    """Hand an admitted job to the orchestrator with a runner token minted for it (its hash
    stored first: the runner may call back at once); a job that cannot be submitted fails
    (and, never having started, gets its reservation back)."""
    token = f"dpr_{secrets.token_urlsafe(32)}"
    begin_write(session)
    session.get(Job, job.id).runner_token_sha256 = digest(token)
    session.commit()
    try:
        orchestrator.submit(Submission(job.id, token, dataset.name))
    except Exception as error:
        apply_state(session, job.id, JobState.FAILED, f"submission failed: {error}")
        return
    begin_write(session)
    session.get(Job, job.id).submitted_at = datetime.now(UTC)
    session.commit()


def refresh(session: Session, orchestrator: Orchestrator, job: Job) -> None:
    """Ask the orchestrator about an active job and record what it says (taking the budget
    lock only when the state changed)."""
    if not JobState(job.status).terminal:
        state = orchestrator.status(job.id)
        if state != job.status:
            apply_state(session, job.id, state)


def reconcile(session: Session, orchestrator: Orchestrator, *, startup: bool = False) -> None:
    """Bring every job the database believes active in line with the orchestrator, settling
    those that ended (at start-up: while the service was down). Only submitted jobs are asked
    about — an admitted job may be a moment away from its submission. At start-up a job
    admitted but never submitted (the service stopped in between) fails, and since it never
    ran, its whole reservation is released."""
    active = [JobState.QUEUED.value, JobState.RUNNING.value]
    query = select(Job.id, Job.submitted_at).where(Job.status.in_(active))
    rows = session.execute(query).all()
    submitted = [job_id for job_id, at in rows if at is not None]
    for job_id, state in orchestrator.reconcile(submitted).items():
        apply_state(session, job_id, state)
    if startup:
        for job_id in (job_id for job_id, at in rows if at is None):
            apply_state(
                session,
                job_id,
                JobState.FAILED,
                "never submitted: the service stopped before handing the job to the orchestrator",
            )


def apply_state(session: Session, job_id: int, state: JobState, error: str | None = None) -> None:
    """Record a state reported by the orchestrator or the job's runner, in its own locked
    transaction (:func:`transition`)."""
    dataset_id = session.get(Job, job_id).dataset_id
    try:
        locked_dataset(session, dataset_id)
        transition(session, session.get(Job, job_id, populate_existing=True), state, error)
        session.commit()
    except BaseException:
        session.rollback()
        raise


def transition(session: Session, job: Job, state: JobState, error: str | None = None) -> None:
    """The job state machine: the only code that changes ``Job.status``. The caller holds the
    dataset's budget lock and commits.

    A terminal job never changes again. When a job starts, everything it owes from then on is
    charged — under random stopping its whole bound, before K is drawn, so that when the
    ledger changes does not depend on K. When it ends, its ledger is settled
    (:func:`service.ledger.settle`); a ``lost`` job is recorded as failed with its whole
    reservation charged."""
    if JobState(job.status).terminal or job.status == state:
        return
    now = datetime.now(UTC)
    if state in (JobState.RUNNING, JobState.SUCCEEDED) and job.started_at is None:
        job.started_at = now
        ledger.charge_what_ran(session, job)
    lost = state == JobState.LOST
    job.status = JobState.FAILED if lost else state
    if lost:
        error = "the orchestrator has no record of this job: its whole reservation is charged"
    job.error = error or job.error
    if state.terminal:
        job.finished_at = now
        ledger.settle(session, job, charge_reservation=lost)
