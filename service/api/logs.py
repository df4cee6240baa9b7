"""A job's driver log, for operators: what the job printed may quote its private data (a
trial's error, a metric), so it is never shown to analysts (docs/design.md, invariant 4)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from core.spec import MAX_ID
from core.views import LogOut
from service.api.deps import Id, Operator, OrchestratorDep, SessionDep, visible_job
from service.api.errors import COMMON, responses
from service.orchestration import Inspectable, OrchestratorUnavailable

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=COMMON)


@router.get("/{job_id}/logs", responses=responses(403, 404, 503))
def get_logs(
    job_id: Id,
    session: SessionDep,
    caller: Operator,
    orchestrator: OrchestratorDep,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> LogOut:
    """The job's driver log (Ray: the Ray job's log, the runner's and Ray Tune's output),
    paged in lines: ``limit`` lines from line ``offset``. Empty for a job not handed to the
    cluster yet, or on an orchestrator that keeps no logs; 503 when the cluster does not
    answer (try again)."""
    job = visible_job(session, caller, job_id)
    text = ""
    if job.submitted_at is not None and isinstance(orchestrator, Inspectable):
        try:
            text = orchestrator.logs(job_id)
        except OrchestratorUnavailable as error:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot read the job's log now: {error}"
            ) from None
    lines = text.splitlines()
    page = lines[offset : offset + limit]
    return LogOut(lines=page, offset=offset, total=len(lines), next_offset=offset + len(page))
