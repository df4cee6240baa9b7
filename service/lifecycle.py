"""A job's life in the control plane: admission (plan + reservation in one locked
transaction), state changes reported by the orchestrator, and settlement of its ledger."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import accounting
from core.spec import JobSpec
from service import ledger
from service.auth import Principal, digest
from service.db import Dataset, Job, begin_write, locked_dataset
from service.orchestration import JobState, Orchestrator, OrchestratorUnavailable, Submission
from service.planning import PlannedJob

log = logging.getLogger(__name__)


class BudgetExceeded(Exception):
    """The job does not fit; ``field`` is the spec field to change."""

    def __init__(self, budget: ledger.Budget, job_epsilon: float) -> None:
        if math.isinf(budget.committed):
            self.field = "privacy.delta"
            pairs = accounting.Filter(budget.epsilon, budget.delta).pair_delta
            message = (
                f"the job does not fit: the δs of (ε, δ) statements (Liu–Talwar jobs, caps on K) "
                f"would exceed {pairs:g}, the share of the dataset's δ {budget.delta:g} they may "
                "hold; ask for a smaller δ"
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


class DatasetGone(LookupError):
    """The job's dataset was deleted after it was planned (``DELETE /v1/datasets/{id}``)."""


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
        if dataset is None:
            raise DatasetGone(f"dataset {spec.dataset} not found")
        if (earlier := _earlier(session, principal, idempotency_key, digest)) is not None:
            session.commit()
            return earlier, False
        vec, after = ledger.statement(session, dataset, planned.reservation)
        if after.committed > dataset.epsilon:
            raise BudgetExceeded(after, planned.plan.epsilon)
        job = Job(
            dataset_id=dataset.id,
            owner_key_id=principal.key_id,
            idempotency_key=idempotency_key,
            request_sha256=digest,
            spec=planned.spec.model_dump(mode="json"),  # with the planner's defaults
            plan=planned.plan.model_dump(mode="json"),
            accounting=spec.privacy.accounting,
            status=JobState.QUEUED,
        )
        session.add(job)
        try:
            session.flush()
        except IntegrityError:
            # the same key, admitted at the same instant under another dataset's lock: the
            # first job stands, as if this request had come second
            session.rollback()
            if (earlier := _earlier(session, principal, idempotency_key, digest)) is None:
                raise
            session.commit()
            return earlier, False
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


def _earlier(
    session: Session, principal: Principal, idempotency_key: str | None, digest: str
) -> Job | None:
    """The caller's job admitted with ``idempotency_key``, if any; :class:`IdempotencyConflict`
    when it was admitted for another spec."""
    if idempotency_key is None:
        return None
    earlier = session.execute(
        select(Job).where(
            Job.owner_key_id == principal.key_id, Job.idempotency_key == idempotency_key
        )
    ).scalar_one_or_none()
    if earlier is not None and earlier.request_sha256 != digest:
        raise IdempotencyConflict("Idempotency-Key was already used for a different job spec")
    return earlier


class _PerJob:
    """Serializes, within this process, what hands one job to the orchestrator: the POST that
    admitted it, the poller, a cancel."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._busy: set[int] = set()

    @contextmanager
    def hold(self, job_id: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: job_id not in self._busy)
            self._busy.add(job_id)
        try:
            yield
        finally:
            with self._changed:
                self._busy.discard(job_id)
                self._changed.notify_all()


_handing_over = _PerJob()


def submit(session: Session, orchestrator: Orchestrator, job_id: int) -> None:
    """Hand an admitted job to the orchestrator — once — or, when it does not answer, leave
    the job ``queued`` with ``submitted_at`` unset and its reservation held: the poller hands
    it over when the orchestrator answers again (:func:`submit_pending`). Nothing is charged
    or released meanwhile: no trial has run.

    Once: the orchestrator files each job under a name made from its id (Ray: the submission
    id ``dptune-<ns>-job-<id>``) and takes a second submission of it as done; within this
    process one job is handed over by one caller at a time. A job's runner token is minted
    for each try (only its hash is stored, first: the runner may call back at once), so a
    retry first asks whether an earlier try got through — a lost reply, or a service that
    stopped in between — and if so records the job as submitted with the token it got.
    A job the orchestrator refuses fails, and having never run, gets its reservation back."""
    with contextlib.suppress(OrchestratorUnavailable), _handing_over.hold(job_id):
        _hand_over(session, orchestrator, job_id)


def submit_pending(session: Session, orchestrator: Orchestrator) -> None:
    """Submit, in id order, every admitted job not handed to the orchestrator yet; stop at the
    first sign that it does not answer (the next round tries again)."""
    active = [JobState.QUEUED.value, JobState.RUNNING.value]
    query = (
        select(Job.id).where(Job.status.in_(active), Job.submitted_at.is_(None)).order_by(Job.id)
    )
    for job_id in session.execute(query).scalars().all():
        try:
            with _handing_over.hold(job_id):
                _hand_over(session, orchestrator, job_id)
        except OrchestratorUnavailable as error:
            log.warning("job %d stays queued (%s); trying again", job_id, error)
            return


def _hand_over(session: Session, orchestrator: Orchestrator, job_id: int) -> None:
    job = session.get(Job, job_id, populate_existing=True)
    session.commit()
    if job is None or job.submitted_at is not None or JobState(job.status).terminal:
        return
    earlier = job.runner_token_sha256
    if earlier is not None:  # an earlier try may have got through
        state = orchestrator.status(job_id)
        if state != JobState.LOST or job.status != JobState.QUEUED:
            _record_submitted(session, job_id)
            apply_state(session, job_id, state)
            return
    token = f"dpr_{secrets.token_urlsafe(32)}"
    dataset = session.get(Dataset, job.dataset_id)
    assert dataset is not None  # datasets are never deleted
    if not _mint(session, job_id, earlier, digest(token)):
        return
    try:
        title = _title(job, dataset)
        orchestrator.submit(Submission(job_id, token, dataset.name, title, job.spec["resources"]))
    except OrchestratorUnavailable:
        raise
    except Exception as error:
        apply_state(session, job_id, JobState.FAILED, f"submission failed: {error}")
        return
    _record_submitted(session, job_id)


def _title(job: Job, dataset: Dataset) -> str:
    """The job's name in the cluster's job list: a fixed-K job's trial count, but no count of a
    random-stopping job's trials (K is drawn later, by its runner, and stays secret)."""
    model = job.spec["model"]["name"]
    title = f"dptune job {job.id} · {model} on {dataset.name} · {job.accounting}"
    trials = job.plan["trials"]
    if trials["distribution"] != "fixed":
        return title
    return f"{title} · {trials['max']} trial{'s' if trials['max'] != 1 else ''}"


def _mint(session: Session, job_id: int, earlier: str | None, token_sha256: str) -> bool:
    """Store a new runner token's hash unless the job changed since it was read (another
    process handed it over, or it was cancelled)."""
    begin_write(session)
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    mine = (
        job.status == JobState.QUEUED
        and job.submitted_at is None
        and job.runner_token_sha256 == earlier
    )
    if mine:
        job.runner_token_sha256 = token_sha256
    session.commit()
    return mine


def _record_submitted(session: Session, job_id: int) -> None:
    begin_write(session)
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    job.submitted_at = job.submitted_at or datetime.now(UTC)
    session.commit()


def cancel(session: Session, orchestrator: Orchestrator, job_id: int) -> None:
    """Stop a job. One not handed to the orchestrator yet is cancelled here and now with its
    whole reservation released: it cannot have touched data even if an earlier try did reach
    the orchestrator, since a cancelled job's runner can record — and so run — no attempt
    (that job is still asked to stop, if the orchestrator answers). For a submitted job,
    raises :class:`OrchestratorUnavailable` when the request to stop cannot be delivered."""
    with _handing_over.hold(job_id):
        job = session.get(Job, job_id, populate_existing=True)
        session.commit()
        assert job is not None
        if job.submitted_at is None and job.status == JobState.QUEUED:
            apply_state(session, job_id, JobState.CANCELLED)
            if job.runner_token_sha256 is not None:
                with contextlib.suppress(OrchestratorUnavailable):
                    orchestrator.cancel(job_id)
            return
    orchestrator.cancel(job_id)
    refresh(session, orchestrator, job_id)


def refresh(session: Session, orchestrator: Orchestrator, job_id: int) -> None:
    """Ask the orchestrator about a submitted, active job and record what it says (taking the
    budget lock only when the state changed). When it does not answer the job is left as it
    is: unreachable is not lost."""
    job = session.get(Job, job_id, populate_existing=True)
    session.commit()
    if job is None or job.submitted_at is None or JobState(job.status).terminal:
        return
    try:
        state = orchestrator.status(job_id)
    except OrchestratorUnavailable:
        return
    if state != job.status:
        apply_state(session, job_id, state)


def reconcile(session: Session, orchestrator: Orchestrator) -> None:
    """Bring every submitted, active job in line with the orchestrator, settling those that
    ended (at start-up: while the service was down). Jobs not handed over yet are
    :func:`submit_pending`'s; jobs the orchestrator cannot tell about right now are left as
    they are."""
    active = [JobState.QUEUED.value, JobState.RUNNING.value]
    query = select(Job.id).where(Job.status.in_(active), Job.submitted_at.is_not(None))
    submitted = list(session.execute(query).scalars())
    session.commit()
    for job_id, state in orchestrator.reconcile(submitted).items():
        apply_state(session, job_id, state)


def abandon(session: Session, reason: str) -> None:
    """Fail every job the orchestrator was running — handed over (or started) and not ended —
    when it has stopped answering for good (``DPTUNE_RAY_GIVE_UP_S``). Each is settled like any
    failed job: charged every attempt it recorded and the rest of its reservation released.
    That is exact because an attempt is recorded, and charged, before it reads data
    (:mod:`service.attempts`), and a failed job can record no more — should its processes
    still run somewhere, they can touch nothing new. Jobs never handed over stay queued:
    nothing of theirs ran."""
    query = select(Job.id).where(
        or_(
            Job.status == JobState.RUNNING.value,
            (Job.status == JobState.QUEUED.value) & Job.submitted_at.is_not(None),
        )
    )
    jobs = list(session.execute(query).scalars())
    session.commit()
    for job_id in jobs:
        apply_state(session, job_id, JobState.FAILED, reason)


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
        _end_open_attempts(job, now)
        ledger.settle(session, job, charge_reservation=lost)


def _end_open_attempts(job: Job, now: datetime) -> None:
    """A job's processes end with it: an attempt that never reported its end (killed with its
    Ray job, or on a node that died) has failed. It stays charged (:func:`ledger.settle`)."""
    for trial in job.trials:
        for attempt in trial.attempts:
            if attempt.ended_at is None:
                attempt.status = trial.status = "failed"
                attempt.ended_at = now
