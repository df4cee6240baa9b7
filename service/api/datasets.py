"""Datasets and their budgets."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from core.spec import Scalar
from service import ledger, visibility
from service.api.deps import Caller, Operator, SessionDep, SettingsDep, visible_dataset
from service.api.errors import field_error
from service.db import Dataset

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

SOURCE = r"^(builtin:(digits|mnist1d|heavy_tail)|npz:[^\x00]{1,250})$"


class DatasetIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[\w.-]+$")
    source: str = Field(
        pattern=SOURCE,
        description="builtin:digits, builtin:mnist1d, "
        "builtin:heavy_tail or npz:<file under DATA_DIR>",
    )
    options: dict[str, Scalar] = Field(default_factory=dict, max_length=20)
    num_classes: int | None = Field(
        None,
        ge=2,
        le=100_000,
        description="the declared label set {0, …, num_classes − 1}: "
        "required for npz files (it is public, so it is not read off the private labels); "
        "optional for builtins, which must then match",
    )
    epsilon: float = Field(gt=0, le=100, description="lifetime budget ε")
    delta: float = Field(gt=0, lt=1, description="lifetime budget δ")


class DatasetOut(BaseModel):
    """What an analyst sees; ``source`` and ``options`` are operator-only."""

    id: int
    name: str
    n: int
    num_classes: int
    input_shape: list[int]
    public_validation: bool
    epsilon: float
    delta: float
    source: str | None = None
    options: dict[str, Any] | None = None
    created_at: datetime | None = None


class EntryOut(BaseModel):
    """A ledger row as the caller sees it (:func:`service.visibility.ledger_entries`)."""

    id: int
    kind: str
    reference: str | None
    job: int | None
    epsilon: float | None = Field(
        description="this row's own ε at the dataset's δ "
        "(null when its δ alone exceeds the dataset's)"
    )
    delta: float = Field(description="δ charged by basic composition (Liu–Talwar jobs, caps)")
    note: str
    created_at: datetime | None = Field(
        description="null for analysts on rows of random-"
        "stopping jobs (lt, ps): their time depends on K"
    )


class BudgetOut(BaseModel):
    epsilon: float
    delta: float
    spent: float
    reserved: float
    remaining: float
    entries: list[EntryOut]


def dataset_out(dataset: Dataset, operator: bool) -> DatasetOut:
    out = DatasetOut.model_validate(dataset, from_attributes=True)
    if not operator:
        out.source = out.options = out.created_at = None
    return out


def _check_source(source: str, data_dir: Path) -> None:
    """``npz:`` paths are relative to DATA_DIR and must stay inside it."""
    if not source.startswith("npz:"):
        return
    relative = Path(source.removeprefix("npz:"))
    if relative.is_absolute() or not (data_dir / relative).resolve().is_relative_to(data_dir):
        raise field_error("source", "npz path must be a file under DATA_DIR")


@router.post("", status_code=status.HTTP_201_CREATED)
def register(
    body: DatasetIn, session: SessionDep, settings: SettingsDep, _: Operator
) -> DatasetOut:
    from workers.data import describe  # loads torch: only when a dataset is registered

    _check_source(body.source, settings.data_path)
    if session.execute(select(Dataset.id).where(Dataset.name == body.name)).first():
        raise field_error("name", f"a dataset named {body.name!r} exists", 409)
    try:
        info = describe(body.source, settings.data_path, body.options, body.num_classes)
    except (ValueError, OSError, KeyError) as error:
        named, _, reason = str(error).removeprefix("dataset.").partition(": ")
        if (named.startswith("options.") or named == "num_classes") and reason:
            raise field_error(named, reason) from None
        raise field_error("source", f"cannot load {body.source!r}: {reason or error}") from None
    dataset = Dataset(
        name=body.name,
        source=body.source,
        options=body.options,
        n=info.n,
        num_classes=info.num_classes,
        input_shape=list(info.input_shape),
        public_validation=info.public_validation,
        epsilon=body.epsilon,
        delta=body.delta,
        content_sha256=info.sha256,
    )
    session.add(dataset)
    session.commit()
    return dataset_out(dataset, operator=True)


@router.get("")
def list_datasets(session: SessionDep, caller: Caller) -> list[DatasetOut]:
    datasets = session.execute(select(Dataset).order_by(Dataset.id)).scalars()
    return [dataset_out(d, caller.is_operator) for d in datasets if caller.sees_dataset(d.id)]


@router.get("/{dataset_id}")
def get_dataset(dataset_id: int, session: SessionDep, caller: Caller) -> DatasetOut:
    return dataset_out(visible_dataset(session, caller, dataset_id), caller.is_operator)


@router.get("/{dataset_id}/budget")
def get_budget(dataset_id: int, session: SessionDep, caller: Caller) -> BudgetOut:
    """Spent and reserved ε, composed over the whole ledger (docs/design.md, invariant 7)."""
    dataset = visible_dataset(session, caller, dataset_id)
    state = ledger.budget(session, dataset)
    entries = visibility.ledger_entries(session, caller, dataset, state.entries)
    return BudgetOut(
        epsilon=state.epsilon,
        delta=state.delta,
        spent=state.spent,
        reserved=state.reserved,
        remaining=state.remaining,
        entries=[EntryOut.model_validate(e, from_attributes=True) for e in entries],
    )
