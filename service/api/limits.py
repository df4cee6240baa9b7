"""Refuse oversized request bodies before anything parses them."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio


class _TooLarge(Exception):
    """A streamed body ran over its limit (raised from ``receive``, answered with 413)."""


class BodyLimit:
    """Pure ASGI middleware: reads the request body itself, at most ``max_bytes`` of it (or
    ``large_bytes`` on paths matching ``large_paths``: model uploads), and answers 413 when
    there is more (whether ``Content-Length`` says so up front or a chunked body runs over);
    otherwise replays the body to the application.

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
    ) -> None:
        self.app = app
        self.max_bytes, self.large_bytes = max_bytes, large_bytes
        self.large_paths = re.compile(large_paths)
        self.streamed_paths, self.streamed_bytes = re.compile(streamed_paths), streamed_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        streamed = self.streamed_paths.fullmatch(scope["path"]) is not None
        if streamed:
            limit = self.streamed_bytes
        else:
            large = self.large_paths.fullmatch(scope["path"])
            limit = self.large_bytes if large else self.max_bytes
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
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

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
        body = json.dumps({"detail": f"body: larger than {limit} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class InFlight:
    """Pure ASGI middleware: at most ``limit`` requests inside the application at once; the
    others wait here, on the event loop, holding nothing. Each request holds at most one
    database connection, so with ``limit`` no larger than the pool no request waits for one.
    Without it, requests past the pool's size deadlocked with it until its timeout (HTTP 500):
    threads waited for connections held by requests that waited for a thread (FastAPI checks a
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
