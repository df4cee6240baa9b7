"""What the service answers: the views of plans, jobs, trials, datasets, budgets, keys and
logs. The service's routes return these (``service/api``; they are its ``/openapi.json``) and
the Python client reads them (``dptune.models`` subclasses each), so both hold one contract.

A field that is ``null`` for some callers is withheld from them: who sees what is decided by
``service.visibility`` (docs/design.md, invariants 4 and 11), never here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from core.plan import Plan


def _stated(value: Any) -> Any:
    """A dataset's ε as a view shows it: a number not finite is none that can be stated."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


#: ε through the dataset's privacy filter, or null where none can be stated at its δ: the
#: (ε, δ) statements hold more than the filter's share of δ (Liu–Talwar jobs admitted before
#: it, docs/privacy.md); nothing more is admitted then
StatedEpsilon = Annotated[float | None, BeforeValidator(_stated)]
STATED = "; null where no ε can be stated at the dataset's δ (docs/privacy.md)"


class PlanOut(Plan):
    """What a job would cost on its dataset (``POST /v1/plans``), before anything is
    reserved."""

    dataset: int
    remaining_epsilon: StatedEpsilon = Field(description="the dataset's remaining ε now" + STATED)
    remaining_epsilon_after: StatedEpsilon = Field(
        description="... and once this job is reserved" + STATED
    )
    fits: bool = Field(description="whether the job's reservation fits the dataset's budget")


class Progress(BaseModel):
    """How far a job is. Under random stopping (lt, ps) the total is ``"random"`` and analysts
    see no count of trials done: the number of trials is not a DP output (invariant 4)."""

    trials_done: int | None
    trials_total: int | Literal["random"]
    best_score: float | None = Field(
        description="the best DP selection score among the trials the caller sees"
    )


class JobOut(BaseModel):
    """A tuning job as the caller sees it. Under random stopping (lt, ps) an analyst sees no
    start or end time (they would tell how many trials ran) and the status queued → running →
    released | failed | cancelled."""

    id: int
    dataset: int
    status: str
    accounting: str
    plan: Plan = Field(description="the plan the job was admitted with (its cost)")
    spec: dict[str, Any]
    released: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None = Field(None, description="operators only: may quote private data")
    reason: str | None = Field(
        None,
        description="why the job is queued, waits or failed: to operators in full (the "
        "cluster's message, the error); to analysts only reasons fixed before the job started",
    )
    progress: Progress
    dashboard_url: str | None = Field(None, description="operators only")


class TrialOut(BaseModel):
    """One trial of a job. Fields that are ``null`` are withheld from analysts (not DP
    outputs)."""

    index: int | None
    params: dict[str, Any]
    score: float | None
    metrics: list[dict[str, Any]]
    thresholds: list[float] | None = Field(
        description="the per-step thresholds of an adaptive clipping rule (DP outputs)"
    )
    released: bool
    status: str | None = None
    steps: int | None = None
    attempts: list[dict[str, Any]] | None = None
    epsilon: float | None = Field(
        None, description="what this trial's attempts cost, at the dataset's δ"
    )
    score_std: float | None = Field(
        None,
        description="the standard deviation of the noise released with a private score "
        "(the plan's `score_std`): scores closer than a few of it are a draw",
    )


class DatasetOut(BaseModel):
    """A dataset and its lifetime budget; ``source``, ``options`` and ``created_at`` are
    operators' only."""

    id: int
    name: str
    n: int
    num_classes: int
    input_shape: list[int]
    public_validation: bool
    public: bool = Field(description="public data, a proxy for tuning (`proxy` in a job spec)")
    awaiting_data: bool = Field(
        description="announced for upload, its file not received yet (n = 0): no job can use it"
    )
    epsilon: float
    delta: float
    source: str | None = None
    options: dict[str, Any] | None = None
    created_at: datetime | None = None


class UploadOut(DatasetOut):
    """The dataset as registered from its upload, and a receipt of the bytes received (compare
    ``file_sha256`` with ``sha256sum`` of the file sent)."""

    file_bytes: int
    file_sha256: str


class EntryOut(BaseModel):
    """A ledger row as the caller sees it (``service.visibility.ledger_entries``)."""

    id: int
    kind: str
    reference: str | None
    job: int | None
    epsilon: float | None = Field(
        description="this row's own ε at the dataset's δ "
        "(null when its δ alone exceeds the dataset's)"
    )
    delta: float = Field(
        description="δ this row holds of the dataset's: the (ε, δ) statements the budget counts "
        "(Liu–Talwar jobs, caps on K, jobs counted as one pair) hold δ by basic composition"
    )
    note: str
    created_at: datetime | None = Field(
        description="null for analysts on rows of random-"
        "stopping jobs (lt, ps): their time depends on K"
    )


class BudgetOut(BaseModel):
    """A dataset's budget (ε at its δ) and how much of it is spent and reserved."""

    epsilon: float
    delta: float
    spent: StatedEpsilon = Field(description="ε of every charge" + STATED)
    reserved: StatedEpsilon = Field(
        description="what outstanding reservations add to `spent`" + STATED
    )
    remaining: StatedEpsilon = Field(description="`epsilon` less spent and reserved" + STATED)
    entries: Sequence[EntryOut] = Field(
        description="the newest ledger rows the caller sees, at most `limit`, oldest first "
        "(the whole ledger: GET /v1/datasets/{id}/ledger)"
    )
    entries_total: int = Field(description="how many ledger rows the caller sees in all")


class LedgerOut(BaseModel):
    """A page of a dataset's ledger."""

    entries: list[EntryOut] = Field(description="ledger rows in id order, at most `limit`")
    next_after: int | None = Field(
        description="the `after` of the next page; null on the last page"
    )


class KeyOut(BaseModel):
    """An API key, without its secret."""

    id: int
    name: str
    role: str
    datasets: list[int]
    created_at: datetime
    bootstrap: bool = Field(description="made by the service at start (DPTUNE_OPERATOR_KEY)")
    revoked_at: datetime | None = Field(description="null while the key is valid")


class NewKeyOut(KeyOut):
    """A key just created, with its secret."""

    secret: str = Field(description="The key itself. Shown only in this response.")


class LogOut(BaseModel):
    """Lines ``offset`` to ``offset + len(lines)`` of the job's driver log (counted from 0),
    of ``total`` lines so far. ``next_offset`` is where the next page starts: the log of a
    job still running grows, so asking there again later returns what it printed since."""

    lines: list[str]
    offset: int
    total: int
    next_offset: int
