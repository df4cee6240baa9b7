"""API keys (operators only): create, list, revoke."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select

from core.spec import MAX_ID, Text
from core.views import KeyOut, NewKeyOut
from service.api.deps import Id, Operator, SessionDep
from service.api.errors import COMMON, field_error, responses
from service.api.listing import COUNTED, Page, page
from service.auth import LastOperator, create_key, revoke
from service.db import ApiKey, Dataset, begin_write

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=COMMON | responses(403))


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text = Field("", max_length=100)
    role: Literal["operator", "analyst"]
    datasets: list[Annotated[int, Field(ge=1, le=MAX_ID)]] = Field(
        default_factory=list, max_length=1000
    )

    @model_validator(mode="after")
    def _scope(self) -> Self:
        if self.role == "operator" and self.datasets:
            raise ValueError("datasets: operator keys see every dataset; leave it empty")
        return self


class KeysQuery(Page):
    status: Literal["active", "revoked"] | None = None
    role: Literal["operator", "analyst"] | None = None
    dataset: int | None = Field(None, ge=1, le=MAX_ID, description="keys scoped to this dataset")


def _out(key: ApiKey) -> dict:
    return {
        "id": key.id,
        "name": key.name,
        "role": key.role,
        "datasets": sorted(d.id for d in key.datasets),
        "created_at": key.created_at,
        "bootstrap": key.bootstrap,
        "revoked_at": key.revoked_at,
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


@router.get("", responses=COUNTED)
def list_keys(
    session: SessionDep, _: Operator, params: Annotated[KeysQuery, Query()], response: Response
) -> list[KeyOut]:
    query = select(ApiKey).order_by(ApiKey.id)
    if params.status is not None:
        revoked = ApiKey.revoked_at.is_not(None)
        query = query.where(revoked if params.status == "revoked" else ~revoked)
    if params.role is not None:
        query = query.where(ApiKey.role == params.role)
    if params.dataset is not None:
        query = query.where(ApiKey.datasets.any(Dataset.id == params.dataset))
    return [KeyOut(**_out(k)) for k in page(session, response, query, params)]


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT, responses=responses(404, 409))
def revoke_key(key_id: Id, session: SessionDep, _: Operator) -> None:
    """Revoke the key: from the next request on it gets 401 everywhere. Its jobs and ledger
    rows stay. 409 for the last operator key (create another first); revoking a revoked key
    changes nothing."""
    begin_write(session)  # of two operators revoking each other's keys, one is left
    key = session.get(ApiKey, key_id)
    if key is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"key {key_id} not found")
    try:
        revoke(session, key)
    except LastOperator as error:
        raise field_error("key", str(error), status.HTTP_409_CONFLICT) from None
    session.commit()
