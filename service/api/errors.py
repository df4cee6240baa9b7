"""Error responses. Every 4xx about the request body is ``{"detail": "<field>: <reason>",
"errors": [{"field", "message"}, …]}``, with fields as dotted paths into the body."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.spec import printable
from service.planning import PlanError

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")
_PLAIN = re.compile(r"^[\w.]+$")


class FieldError(BaseModel):
    field: str
    message: str


class ErrorOut(BaseModel):
    """Every error response. ``errors`` names each field at fault and ``detail`` repeats the
    first as ``"<field>: <reason>"``; an error about no field (no key, an unknown id) has
    ``detail`` only."""

    detail: str
    errors: list[FieldError] | None = None


_MEANING = {
    400: "The body could not be read (not UTF-8 JSON).",
    401: "No valid key: `Authorization: Bearer <key>`.",
    403: "For operators only.",
    404: "No such resource in the caller's scope.",
    409: "Conflicts with the current state (the budget, a repeated request, the job's state).",
    413: "The body is larger than the service accepts.",
    422: "A field is invalid; ``errors`` names it.",
    503: "A dependency (the Ray cluster) does not answer; nothing was changed.",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of the error responses a route may give, so that its schema lists
    every status it answers (tests/service/test_fuzz.py checks each response against it)."""
    return {code: {"model": ErrorOut, "description": _MEANING[code]} for code in codes}


#: what any route may answer: an unreadable, invalid or oversized request, or no valid key
COMMON = responses(400, 401, 413, 422)


def _error(loc: tuple, message: str) -> dict[str, str]:
    """Name the field: the location pydantic reports, or the more precise one that a
    model-level check put at the start of its message."""
    message = message.removeprefix("Value error, ")
    if loc and loc[0] in ("query", "header", "path"):
        field = str(loc[1])  # a parameter name, e.g. "idempotency-key"
    else:  # a path in the body, without pydantic's union-member tags ("constrained-float")
        field = ".".join(str(p) for p in loc[1:] if _PLAIN.match(str(p)))
    prefixed = _FIELD_PREFIX.match(message)
    if prefixed:  # absolute ("privacy.gamma") or relative to the location ("groups")
        named = prefixed.group(1)
        field = named if named.startswith(field) else f"{field}.{named}"
        message = message[prefixed.end() :]
    return {"field": field or "body", "message": message}


def _response(code: int, errors: list[dict[str, str]]) -> JSONResponse:
    errors = [{name: printable(str(value)) for name, value in e.items()} for e in errors]
    first = errors[0]
    return JSONResponse(
        {"detail": f"{first['field']}: {first['message']}", "errors": errors}, status_code=code
    )


def field_error(field: str, message: str, code: int = 422) -> HTTPException:
    return HTTPException(code, {"field": field, "message": message})


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_error(tuple(e["loc"]), e["msg"]) for e in exc.errors()]
        return _response(status.HTTP_422_UNPROCESSABLE_CONTENT, errors)

    @app.exception_handler(PlanError)
    async def _plan(_: Request, exc: PlanError) -> JSONResponse:
        return _response(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            [{"field": exc.field, "message": str(exc).split(": ", 1)[1]}],
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.detail, dict):
            return _response(exc.status_code, [exc.detail])
        return JSONResponse(
            {"detail": printable(str(exc.detail))}, exc.status_code, headers=exc.headers
        )
