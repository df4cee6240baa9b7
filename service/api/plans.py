"""Privacy plans: what a job would cost, without reserving anything."""

from __future__ import annotations

from fastapi import APIRouter

from core.spec import JobSpec
from core.views import PlanOut
from service import ledger
from service.api.deps import Caller, SessionDep, SettingsDep, job_dataset
from service.api.errors import COMMON, responses
from service.api.shedding import RESPONSES as SHED
from service.own_models import plan_with_model

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=COMMON)


@router.post("", responses=responses(404) | SHED)
def plan(spec: JobSpec, session: SessionDep, caller: Caller, settings: SettingsDep) -> PlanOut:
    """What the job would cost, and the inspection of an imported model (``model``). Runs
    in the planning pool (:class:`service.api.shedding.Planning`): 429 or 503 when it is
    full."""
    dataset = job_dataset(session, caller, spec)
    planned = plan_with_model(spec, dataset, session, settings)
    now = ledger.budget(session, dataset)
    after = ledger.statement(session, dataset, planned.reservation)[1]
    return PlanOut(
        **planned.plan.model_dump(),
        dataset=dataset.id,
        remaining_epsilon=now.remaining,
        remaining_epsilon_after=after.remaining,
        fits=after.committed <= dataset.epsilon,
    )
