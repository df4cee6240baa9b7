"""Refuse oversized or too deeply nested request bodies before anything parses them, and hold
back requests past what the database pool serves at once."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

import anyio

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted on its bytes without
    parsing it (a parser recurses once per level: ``json``'s and pydantic's raise
    ``RecursionError`` a few hundred levels down). Brackets inside strings do not count;
    text that is not JSON gets some number, and its parser refuses it."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


class _TooLarge(Exception):
    """A streamed body ran over its limit (raised from ``receive``, answered with 413)."""


class BodyLimit:
    """Pure ASGI middleware: reads the request body itself, at most ``max_bytes`` of it (or
    ``large_bytes`` on paths matching ``large_paths``: model uploads), and answers 413 when
    there is more (whether ``Content-Length`` says so up front or a chunked body runs over);
    otherwise replays the body to the application. A body of at most ``max_bytes`` that nests
    deeper than ``max_depth`` (:func:`json_depth`) is answered 422 before anything parses it.

    On paths matching ``streamed_paths`` (dataset uploads, up to ``streamed_bytes``) the body is
    not held in memory: the application reads it as it arrives, and the chunk that runs over
    the limit raises out of ``receive`` instead; the handler must clean up what it wrote."""

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        large_paths: str = r"(?!)",
        large_bytes: int = 0,
        streamed_paths: str = r"(?!)",
        streamed_bytes: int = 0,
        max_depth: int = 64,
    ) -> None:
        self.app = app
        self.max_depth = max_depth
        self.max_bytes, self.large_bytes = max_bytes, large_bytes
        self.large_paths = re.compile(large_paths)
        self.streamed_paths, self.streamed_bytes = re.compile(streamed_paths), streamed_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        streamed = self.streamed_paths.fullmatch(scope["path"]) is not None
        large = not streamed and self.large_paths.fullmatch(scope["path"]) is not None
        limit = self.streamed_bytes if streamed else self.large_bytes if large else self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send, limit)
            return
        if streamed:
            await self._stream(scope, receive, send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(send, limit)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if not large and json_depth(body) > self.max_depth:
            detail = f"body: nested deeper than {self.max_depth} arrays and objects"
            await _answer(send, 422, {"detail": detail, "errors": [_field(detail)]})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _stream(self, scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        size = 0

        async def counted() -> dict[str, Any]:
            nonlocal size
            message: dict[str, Any] = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send, limit)

    async def _refuse(self, send: Any, limit: int) -> None:
        await _answer(send, 413, {"detail": f"body: larger than {limit} bytes"})


def _field(detail: str) -> dict[str, str]:
    field, message = detail.split(": ", 1)
    return {"field": field, "message": message}


async def _answer(send: Any, status: int, content: dict[str, Any]) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class InFlight:
    """Pure ASGI middleware: at most ``limit`` requests inside the application at once; the
    others wait here, on the event loop, holding nothing. Each request holds at most one
    database connection, so with ``limit`` no larger than the pool no request waits for one.
    Without it, requests past the pool's size would deadlock with it until its timeout (HTTP
    500): threads wait for connections held by requests that wait for a thread (FastAPI checks a
    sync endpoint's response in one). ``/healthz`` is not held back: a probe must answer under
    load."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.gate = anyio.Semaphore(limit)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        async with self.gate:
            await self.app(scope, receive, send)
