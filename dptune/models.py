"""Typed views of what the service answers. Each allows fields it does not name
(``extra="allow"``), so a newer service's additions reach the caller instead of breaking the
client; only what the client and CLI use is named."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

#: job states after which nothing changes
FINAL = frozenset({"succeeded", "released", "failed", "cancelled"})


class View(BaseModel):
    model_config = ConfigDict(extra="allow")


class Progress(View):
    trials_done: int | None = None
    trials_total: int | Literal["random"] | None = None
    best_score: float | None = None


class JobView(View):
    """A job as the key sees it (GET /v1/jobs/{id})."""

    id: int
    dataset: int
    status: str
    accounting: str
    released: bool = False
    reason: str | None = None
    error: str | None = None
    progress: Progress = Progress()
    plan: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        return self.status in FINAL


class Trial(View):
    index: int | None = None
    params: dict[str, Any] = {}
    score: float | None = None
    released: bool = False
    status: str | None = None


class Entry(View):
    id: int
    kind: str
    job: int | None = None
    epsilon: float | None = None
    note: str = ""


class Budget(View):
    epsilon: float
    delta: float
    spent: float
    reserved: float
    remaining: float
    entries: list[Entry] = []


class Dataset(View):
    id: int
    name: str
    n: int
    epsilon: float
    delta: float


class Plan(View):
    """What a job would cost (POST /v1/plans)."""

    dataset: int
    accounting: str
    epsilon: float
    remaining_epsilon: float
    remaining_epsilon_after: float
    fits: bool


class Key(View):
    id: int
    name: str
    role: str
    datasets: list[int] = []
    revoked_at: str | None = None
    secret: str | None = None  # only in the answer that created the key


class Logs(View):
    lines: list[str]
    offset: int
    total: int
    next_offset: int
