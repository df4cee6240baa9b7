"""Privacy plans: what a job would cost, without reserving anything."""

from __future__ import annotations

from fastapi import APIRouter

from core.spec import JobSpec
from service import ledger
from service.api.deps import Caller, SessionDep, visible_dataset
from service.planning import Plan, plan_job

router = APIRouter(prefix="/v1/plans", tags=["plans"])


class PlanOut(Plan):
    dataset: int
    remaining_epsilon: float  # the dataset's remaining ε now ...
    remaining_epsilon_after: float  # ... and once this job is reserved
    fits: bool


@router.post("")
def plan(spec: JobSpec, session: SessionDep, caller: Caller) -> PlanOut:
    dataset = visible_dataset(session, caller, spec.dataset)
    planned = plan_job(spec, dataset, session)
    now = ledger.budget(session, dataset)
    after = ledger.budget(session, dataset, plus=ledger.amount(planned.reservation))
    return PlanOut(
        **planned.plan.model_dump(),
        dataset=dataset.id,
        remaining_epsilon=now.remaining,
        remaining_epsilon_after=after.remaining,
        fits=after.committed <= dataset.epsilon,
    )
