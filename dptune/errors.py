"""What the client raises. An :class:`ApiError` carries the service's error body: ``detail``
(``"<field>: <reason>"``) and ``errors`` (``[{"field", "message"}, …]``), as
service/api/errors.py answers every 4xx/5xx."""

from __future__ import annotations

from typing import Any


class DptuneError(Exception):
    """Anything the client raises: the service unreachable, a job that did not end in time,
    an error answer (:class:`ApiError`)."""


class ApiError(DptuneError):
    """The service answered ``status`` (4xx/5xx). ``field`` names the part of the request at
    fault (a dotted path into the body, a parameter), or is None when the error is about no
    field (no key, an unknown id)."""

    def __init__(self, status: int, field: str | None, message: str, body: Any = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.status = status
        self.field = field
        self.message = message
        self.body = body


class Unauthorized(ApiError):
    """401 or 403: no valid key, or a key without the role or scope asked for."""


class NotFound(ApiError):
    """404: no such resource in the key's scope."""


class Conflict(ApiError):
    """409: the budget does not cover the job, a repeated idempotency key with another body,
    or the job's state (no released model yet, a job that cannot be cancelled)."""


class Refused(ApiError):
    """422: an invalid field; ``field`` names it."""


class Overloaded(ApiError):
    """429 or 503: the service or the Ray cluster is busy; nothing was changed. Try again
    after ``retry_after`` seconds (None when the service did not say)."""

    def __init__(
        self,
        status: int,
        field: str | None,
        message: str,
        body: Any = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, field, message, body)
        self.retry_after = retry_after


_KINDS: dict[int, type[ApiError]] = {
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: Refused,
}


def _parse(body: Any) -> tuple[str | None, str]:
    """The first field at fault and its message, from ``errors`` when the body names one,
    else the whole ``detail``."""
    if not isinstance(body, dict):
        return None, str(body)
    errors = body.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        return errors[0].get("field"), str(errors[0].get("message", ""))
    return None, str(body.get("detail", body))


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def api_error(status: int, body: Any, retry_after: str | None = None) -> ApiError:
    """The error for an answer ``status`` with ``body`` (parsed JSON, or text)."""
    field, message = _parse(body)
    if status in (429, 503):
        return Overloaded(status, field, message, body, _seconds(retry_after))
    return _KINDS.get(status, ApiError)(status, field, message, body)
