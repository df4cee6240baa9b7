"""The query of every list endpoint, and its total count.

A list takes only the query parameters it declares: an unknown one (``?stauts=running``) is a
422 naming it, never silently ignored, so that a mistyped filter cannot pass for an empty or
unfiltered answer. The body stays a JSON list, as clients read it; the header
``X-Total-Count`` says how many items match the filters in all, across pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from core.spec import MAX_ID

T = TypeVar("T")

TOTAL = "X-Total-Count"

#: the OpenAPI declaration of a list's 200 response: its ``X-Total-Count`` header
COUNTED: dict[int | str, dict[str, Any]] = {
    200: {
        "headers": {
            TOTAL: {
                "description": "how many items match the filters in all, across pages",
                "schema": {"type": "integer"},
            }
        }
    }
}


class ListQuery(BaseModel):
    """Query parameters of a list: only those declared (422 naming any other)."""

    model_config = ConfigDict(extra="forbid")


class Page(ListQuery):
    limit: int = Field(100, ge=1, le=1000, description="at most this many items")
    offset: int = Field(0, ge=0, le=MAX_ID, description="skip this many items first")


class JobsQuery(Page):
    status: Literal["queued", "running", "succeeded", "released", "failed", "cancelled"] | None = (
        Field(None, description="jobs in this status, as the caller sees it")
    )
    dataset: int | None = Field(None, ge=1, le=MAX_ID, description="jobs on this dataset")


def count(session: Session, query: Select[Any]) -> int:
    """How many rows ``query`` selects."""
    counted = select(func.count()).select_from(query.order_by(None).subquery())
    return session.execute(counted).scalar_one()


def page(session: Session, response: Response, query: Select[Any], params: Page) -> Sequence[Any]:
    """The page of ``query``'s rows that ``params`` asks for; their total in ``X-Total-Count``."""
    response.headers[TOTAL] = str(count(session, query))
    return session.execute(query.limit(params.limit).offset(params.offset)).scalars().all()


def page_of(response: Response, items: Sequence[T], params: Page) -> Sequence[T]:
    """The page of ``items`` (already filtered) that ``params`` asks for; their total in
    ``X-Total-Count``. For filters only Python can apply (what an analyst sees of a job)."""
    response.headers[TOTAL] = str(len(items))
    return items[params.offset : params.offset + params.limit]
