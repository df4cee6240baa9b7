"""The runner's API: what a job's runner (the Ray driver and its trials, package ``runner``)
reports to the control plane, authenticated by the job-scoped token minted when the job was
submitted (docs/design.md, invariant 10: Ray nodes hold no database credentials and no
operator key).

A token is good for its own job only (any other job answers 404) and for these calls only:
read the job's trial contract, mark the job started, start an attempt (charged before it
touches data; 409 when the reservation does not cover it), record progress, finish an attempt,
mark a dead trial's open attempts failed, upload the selected trial's weights, ask how long
to hold the job's resources, and report the job's end. None of them can reduce a charge:
attempts only add charges, and settlement releases only the reservation of what never ran,
computed here from the recorded attempts.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, field_validator, model_validator
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from sqlalchemy.orm import Session

from core.config import DatasetConfig, StateTensor, Strict
from core.shapes import plan_shapes, shape_of
from core.spec import LEVEL, MAX_ID, JobSpec, Scalar, check_json, printable
from service import attempts, ledger, lifecycle, visibility
from service.api.deps import Id, SessionDep, SettingsDep
from service.api.errors import COMMON, field_error, responses
from service.auth import digest
from service.db import Dataset, Job, Trial, TrialAttempt
from service.orchestration import JobState

router = APIRouter(
    prefix="/internal/v1/jobs/{job_id}",
    tags=["runner (internal)"],
    responses=COMMON | responses(404),  # any job but the token's own: 404
)
#: request paths of model uploads, which may be larger than other bodies
MODEL_UPLOAD_PATHS = r"/internal/v1/jobs/\d+/trials/\d+/model"

_bearer = HTTPBearer(auto_error=False, description="the job's runner token")


def runner_job(
    request: Request,
    job_id: Id,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The job id, when the request carries that job's runner token; 404 otherwise (a token
    of another job must not even learn whether this one exists)."""
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a job token is required",
            headers={"WWW-Authenticate": "Bearer"},
        )
    with request.app.state.sessions() as session:
        job = session.get(Job, job_id)
        expected = job.runner_token_sha256 if job is not None else None
    if expected is None or not hmac.compare_digest(expected, digest(credentials.credentials)):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} not found")
    return job_id


RunnerJob = Annotated[int, Depends(runner_job)]
Index = Annotated[int, Path(ge=0, le=MAX_ID)]  # a trial's index in its job


class JobContextOut(BaseModel):
    """What the runner needs: the admitted spec and plan (its ``method`` says how the trials
    are charged), and the dataset's trial contract (``core.config.DatasetConfig``: source,
    options, declared label set, content hash)."""

    job_id: int
    spec: dict[str, Any]
    plan: dict[str, Any]
    dataset: dict[str, Any]
    proxy: dict[str, Any] | None = None  # the public dataset the job searches on, if any


class Stored(Strict):
    """A body whose values are stored and shown in views: JSON that every database stores and
    every response renders — finite numbers, at most ``MAX_DEPTH`` levels, strings that are
    text (no lone surrogate, no NUL). Python's JSON parser accepts NaN and Infinity, which are
    not JSON: PostgreSQL refuses to store them, and no response may carry them."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        check_json(data)
        return data


class AttemptIn(Stored):
    index: int = Field(ge=0, le=MAX_ID)
    params: dict[str, Scalar]  # the candidate's hyperparameters
    node: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}$")  # the Ray node id, hex


class AttemptOut(BaseModel):
    attempt: int


class ProgressIn(Stored):
    steps: int = Field(ge=0, le=MAX_ID)
    metrics: list[dict[str, Any]] = Field(max_length=10_000)


class FinishIn(Strict):
    status: Literal["succeeded", "failed"]
    steps: int = Field(ge=0, le=MAX_ID)
    score: float | None = None
    thresholds: list[float] | None = None


class EndIn(Strict):
    state: Literal["released", "succeeded", "failed"]
    #: stored as text: what cannot be (NUL, a lone surrogate) is escaped, never refused, so
    #: that the job's end is recorded whatever its error says
    error: str | None = Field(None, max_length=2000)

    @field_validator("error", mode="before")
    @classmethod
    def _text(cls, error: Any) -> Any:
        return printable(error) if isinstance(error, str) else error


class EndOut(BaseModel):
    epsilon: float  # the job's charges composed, at ...
    delta: float  # ... the job's δ


def dataset_config(dataset: Dataset) -> DatasetConfig:
    """The dataset as trials load it: registered source, options, label set and hash."""
    return DatasetConfig(
        source=dataset.source,
        options=dataset.options,
        num_classes=dataset.num_classes,
        sha256=dataset.content_sha256,
    )


def _job(session: Session, job_id: int) -> Job:
    return session.get(Job, job_id)  # type: ignore[return-value]  # checked by runner_job


def _attempt(session: Session, job_id: int, attempt_id: int) -> TrialAttempt:
    attempt = session.get(TrialAttempt, attempt_id)
    trial = session.get(Trial, attempt.trial_id) if attempt is not None else None
    if trial is None or trial.job_id != job_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"attempt {attempt_id} not found")
    return attempt  # type: ignore[return-value]


@router.get("")
def context(job_id: RunnerJob, session: SessionDep) -> JobContextOut:
    job = _job(session, job_id)
    dataset = session.get(Dataset, job.dataset_id)
    assert dataset is not None
    proxy = session.get(Dataset, job.spec["proxy"]) if job.spec.get("proxy") else None
    return JobContextOut(
        job_id=job.id,
        spec=job.spec,
        plan=job.plan,
        dataset=dataset_config(dataset).model_dump(mode="json"),
        proxy=None if proxy is None else dataset_config(proxy).model_dump(mode="json"),
    )


@router.post("/start", status_code=status.HTTP_204_NO_CONTENT)
def start(job_id: RunnerJob, session: SessionDep) -> Response:
    """The job is running: from here on it owes its whole bound if it is a random-stopping
    job (charged now, before the runner draws K)."""
    lifecycle.apply_state(session, job_id, JobState.RUNNING)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/attempts", status_code=status.HTTP_201_CREATED, responses=responses(409))
def start_attempt(job_id: RunnerJob, body: AttemptIn, session: SessionDep) -> AttemptOut:
    """Record and charge an attempt before it reads data; 409 when not covered."""
    try:
        attempt = attempts.start_attempt(session, job_id, body.index, body.params, body.node)
    except attempts.AttemptRefused as refused:
        raise field_error("index", str(refused), status.HTTP_409_CONFLICT) from None
    return AttemptOut(attempt=attempt)


@router.post("/attempts/{attempt_id}/progress", status_code=status.HTTP_204_NO_CONTENT)
def progress(job_id: RunnerJob, attempt_id: Id, body: ProgressIn, session: SessionDep) -> Response:
    _attempt(session, job_id, attempt_id)
    attempts.record_progress(session, attempt_id, body.steps, body.metrics)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/attempts/{attempt_id}/finish", status_code=status.HTTP_204_NO_CONTENT)
def finish(job_id: RunnerJob, attempt_id: Id, body: FinishIn, session: SessionDep) -> Response:
    _attempt(session, job_id, attempt_id)
    attempts.finish_attempt(
        session, attempt_id, body.status, body.steps, body.score, body.thresholds
    )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/trials/{index}/fail-open", status_code=status.HTTP_204_NO_CONTENT)
def fail_open(job_id: RunnerJob, index: Index, session: SessionDep) -> Response:
    """A trial's process died: its attempts that never reported an end are failed (they stay
    charged)."""
    attempts.fail_open_attempts(session, job_id, index)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _best_trial(job: Job) -> Trial | None:
    """The finished trial with the best DP selection score (docs/design.md, invariant 5); of a
    scaling job, its final run (``core.plan.ScalingPlan``: the other runs only chose its lr)."""
    done = {t: t.score for t in job.trials if t.status == "succeeded" and t.score is not None}
    if (scaling := job.plan.get("scaling")) is not None:
        done = {t: s for t, s in done.items() if t.params.get(LEVEL) == len(scaling["levels"])}
    return JobSpec.model_validate(job.spec).selection.best(done)


def _not_the_model(tensors: dict[str, np.ndarray], report: dict[str, Any] | None) -> str | None:
    """Why uploaded weights are not the admitted model's state, if they are not: a release
    holds the state the factory built, with the trained parameters (``workers.release``),
    never a tensor the model added or one of another shape or type. A built-in model has no
    report: the engine's own code builds its state; a job admitted before the layout was
    recorded has none in its report."""
    if report is None or report.get("state") is None:
        return None
    layout = {n: StateTensor.model_validate(t) for n, t in report["state"].items()}
    extra, missing = sorted(tensors.keys() - layout.keys()), sorted(layout.keys() - tensors.keys())
    if extra or missing:
        return f"not the model's tensors: {extra} are not in its state, {missing} are missing"
    for name, want in layout.items():
        got = StateTensor(shape=list(tensors[name].shape), dtype=tensors[name].dtype.name)
        if got != want:
            return (
                f"tensor {name!r} is {got.dtype} {got.shape}, the model's is "
                f"{want.dtype} {want.shape}"
            )
    return None


@router.put("/trials/{index}/model", status_code=status.HTTP_201_CREATED, responses=responses(409))
async def upload_model(
    job_id: RunnerJob, index: Index, request: Request, session: SessionDep, settings: SettingsDep
) -> Response:
    """Release the weights of trial ``index`` (safetensors bytes). Only the best finished trial
    by its DP score may be released, once: the runner cannot pick another, and the first
    upload stands (a retried upload changes nothing). An imported model's weights must be
    exactly the state its factory built at admission, tensor for tensor (invariant 14). The
    file's metadata is written here — the trial config without the dataset part, and the
    dataset's public shape."""
    job = _job(session, job_id)
    best = _best_trial(job)
    if best is None or best.index != index:
        raise field_error(
            "index", f"trial {index} is not the job's best finished trial", status.HTTP_409_CONFLICT
        )
    if job.artifact is not None:
        return Response(status_code=status.HTTP_200_OK)
    try:
        tensors = load_safetensors(await request.body())
    except (SafetensorError, ValueError) as error:
        raise field_error("body", f"not a safetensors file: {error}") from None
    if (unlike := _not_the_model(tensors, job.plan.get("model"))) is not None:
        raise field_error("body", unlike)
    dataset = session.get(Dataset, job.dataset_id)
    assert dataset is not None
    config = (
        JobSpec.model_validate(job.spec)
        .trial_config(
            dataset_config(dataset),
            shape_of(plan_shapes(job.plan), best.params),
            job.plan["delta"],
            best.params,
        )
        .model_dump(mode="json", exclude={"dataset"})
    )
    public = {"num_classes": dataset.num_classes, "input_shape": dataset.input_shape}
    attempts.release_model(session, settings.data_path, best.id, tensors, config, public)
    return Response(status_code=status.HTTP_201_CREATED)


@router.post("/end", responses=responses(409))
def end(job_id: RunnerJob, body: EndIn, session: SessionDep) -> EndOut:
    """The runner is done: ``released`` after a model upload, ``succeeded`` when no trial
    finished, ``failed``. The job is settled; the answer is what it was charged (the runner's
    log ends with it)."""
    job = _job(session, job_id)
    if (body.state == "released") != (job.artifact is not None):
        raise field_error(
            "state",
            f"{body.state!r} does not match whether a model was released",
            status.HTTP_409_CONFLICT,
        )
    lifecycle.apply_state(session, job_id, JobState(body.state), body.error)
    return EndOut(epsilon=ledger.job_charged(session, job), delta=job.plan["delta"])


class HoldOut(BaseModel):
    seconds: float  # how much longer the job keeps its cluster resources; 0: no longer


@router.get("/hold")
def hold(job_id: RunnerJob, session: SessionDep) -> HoldOut:
    """How much longer the job's runner keeps its cluster resources after its last trial: a
    random-stopping job that holds its release keeps them as long as it looks ``running`` to
    its analyst (:func:`service.visibility.hold_left`), so that no other job's start or
    attempt times tell its K (invariant 11). Seconds from now, by the control plane's clock
    alone: the runner's nodes need not agree with it."""
    return HoldOut(seconds=visibility.hold_left(_job(session, job_id)).total_seconds())
