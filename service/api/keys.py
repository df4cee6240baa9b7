"""API keys (operators only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Self

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select

from core.spec import MAX_ID
from service.api.deps import Operator, SessionDep
from service.api.errors import COMMON, field_error, responses
from service.auth import create_key
from service.db import ApiKey, Dataset, begin_write

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=COMMON | responses(403))


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=100)
    role: Literal["operator", "analyst"]
    datasets: list[Annotated[int, Field(ge=1, le=MAX_ID)]] = Field(
        default_factory=list, max_length=1000
    )

    @model_validator(mode="after")
    def _scope(self) -> Self:
        if self.role == "operator" and self.datasets:
            raise ValueError("datasets: operator keys see every dataset; leave it empty")
        return self


class KeyOut(BaseModel):
    id: int
    name: str
    role: str
    datasets: list[int]
    created_at: datetime


class NewKeyOut(KeyOut):
    secret: str = Field(description="The key itself. Shown only in this response.")


def _out(key: ApiKey) -> dict:
    return {
        "id": key.id,
        "name": key.name,
        "role": key.role,
        "datasets": sorted(d.id for d in key.datasets),
        "created_at": key.created_at,
    }


@router.post("", status_code=status.HTTP_201_CREATED)
def create(body: KeyIn, session: SessionDep, _: Operator) -> NewKeyOut:
    begin_write(session)  # read and write in one writer's transaction (SQLite: no "locked")
    datasets = list(session.execute(select(Dataset).where(Dataset.id.in_(body.datasets))).scalars())
    missing = sorted(set(body.datasets) - {d.id for d in datasets})
    if missing:
        raise field_error("datasets", f"no dataset with id {missing[0]}")
    key, secret = create_key(session, body.name, body.role, datasets)
    session.commit()
    return NewKeyOut(**_out(key), secret=secret)


@router.get("")
def list_keys(session: SessionDep, _: Operator) -> list[KeyOut]:
    keys = session.execute(select(ApiKey).order_by(ApiKey.id)).scalars()
    return [KeyOut(**_out(k)) for k in keys]
