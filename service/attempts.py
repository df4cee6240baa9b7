"""What a job runner records about its trials, each call in its own transaction.

:func:`start_attempt` must be called *before* an attempt reads data. Holding the dataset's
budget lock, it refuses attempts that the job's reservation does not cover and charges the
attempt (``rdp``) or, on the job's first attempt, the whole random-stopping bound (``lt``,
``ps``; invariant 3) — so privacy is on the ledger before it is consumed, and a crash
afterwards cannot lose the charge.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.shapes import Shape, plan_shapes, reserved_attempts, shape_of
from service import ledger, lifecycle
from service.db import Artifact, Job, Trial, TrialAttempt, begin_write, locked_dataset
from service.orchestration import JobState


class AttemptRefused(Exception):
    """The attempt is not covered by the job's reservation; it must not touch data."""


def start_attempt(
    session: Session, job_id: int, index: int, params: dict[str, Any], node: str | None = None
) -> int:
    """Record (and charge) attempt n+1 of trial ``index``, run on Ray node ``node``; returns
    the attempt's id."""
    dataset_id = session.get(Job, job_id).dataset_id
    try:
        locked_dataset(session, dataset_id)
        job = session.get(Job, job_id, populate_existing=True)
        if JobState(job.status).terminal:
            raise AttemptRefused(f"job {job_id} is {job.status}")
        trial = next((t for t in job.trials if t.index == index), None)
        _check_covered(job, trial, index, params)
        if trial is None:
            trial = Trial(job_id=job.id, index=index, params=params)
            session.add(trial)
            job.trials.append(trial)
        attempt = TrialAttempt(number=len(trial.attempts) + 1, node=node)
        trial.attempts.append(attempt)
        trial.status = JobState.RUNNING
        session.flush()
        lifecycle.transition(session, job, JobState.RUNNING)
        ledger.charge_what_ran(session, job)
        session.commit()
        return attempt.id
    except BaseException:
        session.rollback()
        raise


def _check_covered(job: Job, trial: Trial | None, index: int, params: dict[str, Any]) -> None:
    """The reservation covers the attempt: a planned trial index, a candidate of a planned
    shape (its charge is that shape's curve), and a retry the plan reserved."""
    plan = job.plan
    cap = plan["trials"]["max"]
    if not 0 <= index < cap:
        raise AttemptRefused(f"trial index {index} outside the plan's {cap} trials")
    shapes = plan_shapes(plan)
    try:
        shape = shape_of(shapes, trial.params if trial is not None else params)
    except ValueError as error:
        raise AttemptRefused(f"trial {index}: {error}") from None
    grid = plan["attempts_reserved"] is not None and plan.get("proxy") is None
    if grid and len(shapes) > 1:
        _check_shape_share(job, shapes, shape, reserved_attempts(plan, shape))
    if trial is None:
        return
    retries = 0 if ledger.tuning_method(job).random_stopping else job.spec["privacy"]["max_retries"]
    if len(trial.attempts) > retries:
        raise AttemptRefused(f"trial {index} has used its {retries} reserved retries")


def _check_shape_share(job: Job, shapes: list[Shape], shape: Shape, share: int) -> None:
    """A fixed-K job reserved its attempts shape by shape (a grid's equally, a scaling job's
    by level): one more attempt of ``shape`` must stay within its share."""
    used = sum(len(t.attempts) for t in job.trials if shape_of(shapes, t.params) == shape)
    if used >= share:
        raise AttemptRefused(
            f"the plan's {share} attempts of batch_size {shape.batch_size}, epochs "
            f"{shape.epochs:g} are used"
        )


def record_progress(
    session: Session, attempt_id: int, steps: int, metrics: list[dict[str, Any]]
) -> None:
    """Record an attempt's progress as it happens: steps run so far and new metric rows
    (``{"name", "value", "epoch", "public"}``; ``public`` marks what analysts may see). An
    attempt that has ended records nothing more."""
    begin_write(session)
    attempt = session.get(TrialAttempt, attempt_id)
    trial = session.get(Trial, attempt.trial_id)
    if attempt.ended_at is None:
        attempt.steps = steps
        trial.metrics = [*trial.metrics, *metrics]
    session.commit()


def finish_attempt(
    session: Session,
    attempt_id: int,
    status: str,
    steps: int,
    score: float | None = None,
    thresholds: list[float] | None = None,
) -> None:
    """Record how an attempt ended: its steps, the DP selection ``score`` and the per-step
    clipping ``thresholds`` of an adaptive rule. The first end recorded stands: a runner's
    retried call, or a straggler's report after its job ended, changes nothing."""
    begin_write(session)
    attempt = session.get(TrialAttempt, attempt_id)
    trial = session.get(Trial, attempt.trial_id)
    if attempt.ended_at is None:
        attempt.status = trial.status = status
        attempt.steps = steps
        attempt.ended_at = datetime.now(UTC)
        trial.steps += steps
        trial.score = score
        trial.thresholds = thresholds
    session.commit()


def fail_open_attempts(session: Session, job_id: int, index: int) -> None:
    """Mark the attempts of trial ``index`` that never reported their end (their process
    died) as failed; their charge was written when they started."""
    begin_write(session)
    trial = session.execute(
        select(Trial).where(Trial.job_id == job_id, Trial.index == index)
    ).scalar_one_or_none()
    for attempt in trial.attempts if trial else []:
        if attempt.ended_at is None:
            attempt.status = trial.status = "failed"
            attempt.ended_at = datetime.now(UTC)
    session.commit()


def release_model(
    session: Session,
    data_dir: Path,
    trial_id: int,
    tensors: dict[str, np.ndarray],
    config: dict[str, Any],
    dataset: dict[str, Any],
) -> Artifact:
    """Store the selected trial's weights under DATA_DIR as safetensors and release them. The
    file's metadata holds the trial config (key ``config``, without its dataset part) and the
    dataset's public shape (key ``dataset``: ``num_classes``, ``input_shape``) — enough to
    rebuild the model, nothing of the operator's source or options."""
    begin_write(session)
    trial = session.get(Trial, trial_id)
    relative = Path("artifacts") / f"job-{trial.job_id}.safetensors"
    path = data_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        tensors, str(path), metadata={"config": json.dumps(config), "dataset": json.dumps(dataset)}
    )
    artifact = Artifact(
        job_id=trial.job_id,
        trial_id=trial.id,
        path=str(relative),
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        config=config,
    )
    session.add(artifact)
    session.commit()
    return artifact
