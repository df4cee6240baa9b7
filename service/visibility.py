"""What a caller may see of jobs, trials and the ledger (docs/design.md, invariant 4 and 11).

The whole policy lives here; the route handlers only shape what these functions return.

Operators see everything. Analysts see DP outputs only: under fixed-K composition (``rdp``)
every trial's DP outputs. Under random stopping (``lt``, ``ps``) the charged bound holds only
if the analyst learns nothing about the number of trials K beyond the released trial, so an
analyst sees of such a job:

- the status queued → running → released | failed (or cancelled, their own action): a job
  that ended without a model is ``failed``, whatever the reason (K = 0, every trial failed);
- no start or end time, no count of trials, only the released trial, without its index;
- ledger rows without their time, and no row that carries no amount.

An analyst's read of such a job never asks the orchestrator (:func:`asks_orchestrator`)
and does the same work whether the job still runs or has ended. What is left is the
wall-clock channel: when the status changes. ``privacy.hold_release`` closes most of it —
the job looks ``running``, with no model, until :func:`hold_until`, and keeps its cluster
resources as long (:func:`hold_left`).
The current time comes from :func:`now` alone, so that tests can move it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Select, String, and_, case, cast, not_, or_, select
from sqlalchemy.orm import Session, aliased, object_session

from core import accounting, hold
from core.shapes import plan_shapes, shape_of
from core.spec import MAX_DEPTH, Selection, printable
from service import ledger
from service.auth import Principal
from service.db import Dataset, Job, LedgerEntry, Trial, TrialAttempt
from service.orchestration import JobState


def now() -> datetime:
    """The current time: the one clock this module reads."""
    return datetime.now(UTC)


@dataclass(frozen=True)
class Progress:
    trials_done: int | None
    trials_total: int | Literal["random"]
    best_score: float | None  # best DP selection score among the trials the caller sees


@dataclass(frozen=True)
class JobView:
    """The fields of a job that depend on who asks."""

    status: str
    released: bool
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    error: str | None  # may quote private data
    dashboard_url: str | None


@dataclass(frozen=True)
class TrialView:
    index: int | None
    params: dict[str, Any]
    score: float | None
    metrics: list[dict[str, Any]]
    thresholds: list[float] | None
    released: bool
    status: str | None = None
    steps: int | None = None
    attempts: list[dict[str, Any]] | None = None
    epsilon: float | None = None
    score_std: float | None = None


def shown(value: Any, depth: int = 0) -> Any:
    """A stored JSON value as any response can carry it, whatever was stored (by a runner, an
    older service, by hand): strings and keys with lone surrogates or NUL escaped, non-finite
    numbers as None, anything nested deeper than ``MAX_DEPTH`` replaced by a note. What a
    runner may store is checked when it is written (``service.api.runner``); this keeps a
    view from failing on a value stored before."""
    match value:
        case str():
            return printable(value)
        case float() if not math.isfinite(value):
            return None
        case dict() | list() if depth >= MAX_DEPTH:
            return f"<nested deeper than {MAX_DEPTH} levels>"
        case dict():
            return {printable(str(k)): shown(v, depth + 1) for k, v in value.items()}
        case list():
            return [shown(v, depth + 1) for v in value]
    return value


@dataclass(frozen=True)
class EntryView:
    id: int
    kind: str
    reference: str | None
    job: int | None
    epsilon: float | None
    delta: float
    note: str
    created_at: datetime | None


def _k_secret(job: Job, caller: Principal) -> bool:
    """Whether the caller must learn nothing about how many trials the job ran."""
    return job.accounting in accounting.RANDOM_STOPPING and not caller.is_operator


def asks_orchestrator(job: Job, caller: Principal) -> bool:
    """Whether the caller's read of the job may ask the orchestrator for its state. Not an
    analyst's of a random-stopping job: the orchestrator is asked only while the job runs,
    so the time the read takes would tell when it ended, and so K, whatever its body says.
    Its state is kept current without them: by the runner's own end call, the service's
    poller (:func:`service.lifecycle.reconcile`) and operators' reads."""
    return not _k_secret(job, caller)


def hold_until(job: Job) -> datetime | None:
    """The earliest time an analyst may see how a started job that holds its release ended:
    as long after its start as the cap on trials would take, run one after another like
    trial 0 (:func:`core.hold.hold_until`, which the job's runner follows too: it keeps its
    cluster resources until then). How long trial 0 takes does not depend on K: such a job
    runs its trials one at a time (``runner.driver.tune_config``), so trial 0 shares its node
    with no trial of its own job. The hold only delays: a job still running at that time
    shows its end when it ends (trials slower than trial 0, or gaps between trials, can push
    it past), and then the time depends on K again.

    None while d is not known yet (the job is held meanwhile). A first attempt that never
    reported its end is taken to have run until the job ended. A job that ended without a
    trial 0 (K = 0, possible under ``ps`` with Poisson K, or a job that stopped before its
    first trial) has nothing to time and is not held: it shows at its end as ``failed``, the
    mechanism's own output for K = 0; the early reveal sets it apart only from a job whose
    every trial failed."""
    first = _first_attempt(job)
    if first is None:
        return job.finished_at
    attempt, params = first
    end = attempt.ended_at or job.finished_at
    if end is None:
        return None
    cap = job.plan["trials"]["max"]
    return hold.hold_until(job.started_at, cap, end - attempt.started_at, _slowest(job, params))


def hold_left(job: Job) -> timedelta:
    """How much longer the job's runner keeps its cluster resources (its last trial's
    process waits, ``runner.job``): until :func:`hold_until` for a started job that holds
    its release, so that no other job's start or attempt times tell its K. Zero for a job
    that does not hold, and while trial 0 is not timed (the runner asks after its last trial,
    when trial 0 has ended)."""
    holds = job.spec["privacy"].get("hold_release", False)
    until = hold_until(job) if holds and job.started_at is not None else None
    return max(until - now(), timedelta(0)) if until is not None else timedelta(0)


def _slowest(job: Job, params: dict[str, Any]) -> float:
    """How many times trial 0's steps the longest shape runs (1 unless the job searches batch
    size or epochs): each trial is timed as if it ran the most steps any shape has, so that
    the hold does not end sooner for a trial 0 that drew a short shape."""
    shapes = plan_shapes(job.plan)
    return max(s.steps for s in shapes) / shape_of(shapes, params).steps


def _outcome_shown(job: Job, caller: Principal) -> bool:
    """Whether the caller may see how the job ended: always, except while the release of a
    started random-stopping job is held from an analyst. (A job that never started drew no
    K and has nothing to hide.)"""
    holds = job.spec["privacy"].get("hold_release", False)  # only lt and ps may hold
    if not _k_secret(job, caller) or not holds or job.started_at is None:
        return True
    until = hold_until(job)
    return until is not None and now() >= until


def _first_attempt(job: Job) -> tuple[TrialAttempt, dict[str, Any]] | None:
    """Trial 0's first attempt and trial 0's parameters, in one statement whether or not the
    job ended: loading every trial would make the time an analyst's request takes grow with
    K, and a second read only once trial 0 has ended would time its end."""
    query = (
        select(TrialAttempt, Trial.params)
        .join(Trial, TrialAttempt.trial_id == Trial.id)
        .where(Trial.job_id == job.id, Trial.index == 0, TrialAttempt.number == 1)
    )
    row = _session(job).execute(query).one_or_none()
    return None if row is None else (row[0], row[1])


def _released_trial(job: Job) -> Trial | None:
    return _session(job).get(Trial, job.artifact.trial_id) if job.artifact else None


def _session(job: Job) -> Session:
    session = object_session(job)
    if session is None:
        raise RuntimeError(f"job {job.id} is not attached to a session")
    return session


def _shown_trials(job: Job, caller: Principal, outcome: bool) -> list[Trial]:
    """Operators and fixed-K jobs: every trial. Random stopping: only the released trial, once
    the analyst may see the job's ``outcome``."""
    if not _k_secret(job, caller):
        return job.trials
    released = _released_trial(job) if outcome else None
    return [released] if released else []


def _status(job: Job, caller: Principal, outcome: bool) -> str:
    """Under random stopping an analyst sees no status that tells more than the release: a
    job that ended without a model (``succeeded``: K = 0 or no trial finished) is ``failed``."""
    if not _k_secret(job, caller):
        return job.status
    if not outcome:
        return JobState.RUNNING
    if job.status in (JobState.SUCCEEDED, JobState.RELEASED):
        return JobState.RELEASED if job.artifact else JobState.FAILED
    return job.status


def _progress(job: Job, caller: Principal, shown: list[Trial]) -> Progress:
    """Under random stopping the total is ``"random"``, and analysts get no count of trials
    done."""
    scores = {t.id: t.score for t in shown if t.score is not None}
    best_trial = Selection.model_validate(job.spec["selection"]).best(scores)
    best = None if best_trial is None else scores[best_trial]
    done = sum(t.status in ("succeeded", "failed") for t in shown)
    return Progress(
        trials_done=None if _k_secret(job, caller) else done,
        trials_total=(
            "random" if job.accounting in accounting.RANDOM_STOPPING else job.plan["trials"]["max"]
        ),
        best_score=best,
    )


def job_view(job: Job, caller: Principal, dashboard_url: str | None = None) -> JobView:
    """The job as the caller sees it. Under random stopping an analyst gets no timestamps (a
    job's duration grows with K)."""
    outcome = _outcome_shown(job, caller)
    secret = _k_secret(job, caller)
    return JobView(
        status=_status(job, caller, outcome),
        released=job.artifact is not None and outcome,
        started_at=None if secret else job.started_at,
        finished_at=None if secret else job.finished_at,
        progress=_progress(job, caller, _shown_trials(job, caller, outcome)),
        error=job.error if caller.is_operator else None,
        dashboard_url=dashboard_url if caller.is_operator else None,
    )


def cancel_refusal(job: Job, caller: Principal) -> str | None:
    """Why the caller may not cancel the job, or None. An analyst cannot cancel a started job
    whose release is held until it is shown: whether the job then stops, or goes on to
    release a model, would tell whether its trials were still running."""
    if _outcome_shown(job, caller):
        return None
    return (
        f"job {job.id} holds its release (privacy.hold_release) and has started: it cannot "
        "be cancelled before its outcome is shown; an operator can cancel it"
    )


def trials(job: Job, caller: Principal) -> list[TrialView]:
    """The trials the caller sees. Operators: everything, with each trial's attempts (and the
    Ray node each ran on) and what they cost. Analysts: DP outputs only — parameters, the DP
    selection score, metrics marked public, adaptive thresholds — and under random stopping
    only the released trial, without its index."""
    if caller.is_operator:
        return _operator_trials(job)
    released = job.artifact.trial_id if job.artifact else None
    secret = _k_secret(job, caller)
    return [
        TrialView(
            index=None if secret else t.index,
            params=shown(t.params),
            score=t.score,
            metrics=shown(
                [m for m in t.metrics if isinstance(m, dict) and m.get("public") is True]
            ),
            thresholds=t.thresholds,
            released=t.id == released,
            score_std=_score_std(job, t),
        )
        for t in _shown_trials(job, caller, _outcome_shown(job, caller))
    ]


def _score_std(job: Job, trial: Trial) -> float | None:
    """The standard deviation of the release noise in a trial's private score (the plan's:
    it depends on the spec and the dataset's registered size alone)."""
    std = job.plan.get("score_std")
    return std if trial.score is not None and isinstance(std, float) else None


def _operator_trials(job: Job) -> list[TrialView]:
    released = job.artifact.trial_id if job.artifact else None

    def epsilon(trial: Trial) -> float | None:
        """What a trial's attempts cost on their own (the job's charge is the ledger's)."""
        if not trial.attempts:
            return None
        curve = len(trial.attempts) * ledger.attempt_rdp(job, trial.params)
        return accounting.epsilon_from_rdp(curve, job.plan["delta"])[0]

    return [
        TrialView(
            index=t.index,
            params=shown(t.params),
            score=t.score,
            metrics=shown(t.metrics),
            thresholds=t.thresholds,
            released=t.id == released,
            status=t.status,
            steps=t.steps,
            epsilon=epsilon(t),
            score_std=_score_std(job, t),
            attempts=[
                {
                    "number": a.number,
                    "status": a.status,
                    "steps": a.steps,
                    "node": a.node,
                    "started_at": a.started_at.isoformat(),
                    "ended_at": a.ended_at.isoformat() if a.ended_at else None,
                }
                for a in t.attempts
            ],
        )
        for t in job.trials
    ]


_OWNER = aliased(Job)
_SHOWN = (
    *(LedgerEntry.id, LedgerEntry.kind, LedgerEntry.reference, LedgerEntry.job_id),
    *(LedgerEntry.epsilon, LedgerEntry.delta, LedgerEntry.shown_epsilon),
    *(LedgerEntry.pld_epsilon, LedgerEntry.pld_delta),
    case((LedgerEntry.shown_epsilon.is_(None), LedgerEntry.rdp)).label("rdp"),
    *(LedgerEntry.note, LedgerEntry.created_at, _OWNER.owner_key_id, _OWNER.accounting),
)


def ledger_entries(
    session: Session, caller: Principal, dataset: Dataset, rows: Select[tuple[LedgerEntry]]
) -> list[EntryView]:
    """The ledger rows that ``rows`` selects, in its order, as the caller sees them. ``rows``
    is :func:`ledger_rows` for this caller (paged or ordered), which leaves out what the
    caller must not see. Every analyst of the dataset sees its rows, which job a row belongs
    to only the job's owner. Rows of random-stopping jobs carry no time for analysts (when the
    bound was charged, at the first trial or at the end when none ran, depends on K).

    One statement: the shown columns and the jobs' owner and accounting, and a row's curve
    only when it has no ε of its own (written before revision 0008): a page of 100 rows read
    300 KB of curves and converted each."""
    query = rows.with_only_columns(*_SHOWN).outerjoin(_OWNER, _OWNER.id == LedgerEntry.job_id)
    views = []
    for row in session.execute(query):
        secret = row.accounting in accounting.RANDOM_STOPPING and not caller.is_operator
        identify = caller.is_operator or row.owner_key_id == caller.key_id
        eps = ledger.entry_epsilon(row, dataset.delta)
        views.append(
            EntryView(
                id=row.id,
                kind=row.kind,
                reference=row.reference if identify else None,
                job=row.job_id if identify else None,
                epsilon=eps if math.isfinite(eps) else None,
                delta=row.delta if row.pld_epsilon is None else row.pld_delta or 0.0,
                note=row.note,
                created_at=None if secret else row.created_at,
            )
        )
    return views


def ledger_rows(caller: Principal, dataset: Dataset) -> Select[LedgerEntry]:
    """The query of the dataset's ledger rows that the caller sees (:func:`ledger_entries`
    shows them), to page through without loading the whole ledger. The rows with no amount
    of random-stopping jobs are left out for analysts: the zero release that older versions
    wrote when such a job ended was dated by its end. :func:`service.ledger.append` writes a
    zero curve as no curve, so those are the rows with ε = δ = 0 and no curve (it counts them
    in ``Dataset.ledger_rows_hidden``: :func:`entries_total`)."""
    query = select(LedgerEntry).where(LedgerEntry.dataset_id == dataset.id)
    if caller.is_operator:
        return query
    random_stopping = select(Job.id).where(
        Job.dataset_id == dataset.id, Job.accounting.in_(accounting.RANDOM_STOPPING)
    )
    no_curve = or_(LedgerEntry.rdp.is_(None), cast(LedgerEntry.rdp, String) == "null")
    hidden = and_(
        LedgerEntry.job_id.is_not(None),  # NULL IN (…) is NULL, and NOT NULL hides the row
        LedgerEntry.job_id.in_(random_stopping),
        LedgerEntry.epsilon == 0,
        LedgerEntry.delta == 0,
        no_curve,
    )
    return query.where(not_(hidden))


def entries_total(caller: Principal, dataset: Dataset) -> int:
    """How many ledger rows the caller sees (:func:`ledger_rows`), from the dataset's counts."""
    hidden = 0 if caller.is_operator else dataset.ledger_rows_hidden
    return dataset.ledger_rows - hidden
