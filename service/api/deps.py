"""Request dependencies: database session, caller, orchestrator, settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from core.spec import MAX_ID, JobSpec
from service.auth import Principal, authenticate
from service.db import Dataset, Job
from service.orchestration import Orchestrator
from service.settings import Settings


def get_db(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_orchestrator(request: Request) -> Orchestrator:
    return request.app.state.orchestrator


_bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer <key>`")


def get_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """401 unless the request carries a valid key. Looked up in a session of its own, so the
    handler's session starts clean (budget transactions must begin with their lock)."""
    caller = None
    if credentials is not None:
        with request.app.state.sessions() as session:
            caller = authenticate(session, credentials.credentials)
    if caller is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid API key is required: Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return caller


def require_operator(caller: Annotated[Principal, Depends(get_caller)]) -> Principal:
    if not caller.is_operator:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this endpoint is for operators")
    return caller


#: a path id: a larger number than the database holds is a 422, not an overflow there
Id = Annotated[int, Path(ge=1, le=MAX_ID)]
SessionDep = Annotated[Session, Depends(get_db)]
Caller = Annotated[Principal, Depends(get_caller)]
Operator = Annotated[Principal, Depends(require_operator)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def visible_dataset(session: Session, caller: Principal, dataset_id: int) -> Dataset:
    """The dataset, or 404 when it does not exist or is outside the caller's scope."""
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or not caller.sees_dataset(dataset_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"dataset {dataset_id} not found")
    return dataset


def job_dataset(session: Session, caller: Principal, spec: JobSpec) -> Dataset:
    """The dataset a job trains on; 404 when it, or the job's proxy, is outside the caller's
    scope."""
    if spec.proxy is not None:
        visible_dataset(session, caller, spec.proxy)
    return visible_dataset(session, caller, spec.dataset)


def visible_job(session: Session, caller: Principal, job_id: int) -> Job:
    """The job, or 404 unless the caller is an operator or the analyst who submitted it (and
    still has its dataset in scope)."""
    job = session.get(Job, job_id)
    if job is None or not (
        caller.is_operator
        or (job.owner_key_id == caller.key_id and caller.sees_dataset(job.dataset_id))
    ):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} not found")
    return job
