"""Refuse oversized request bodies before anything parses them."""

from __future__ import annotations

import json
import re
from typing import Any


class BodyLimit:
    """Pure ASGI middleware: reads the request body itself, at most ``max_bytes`` of it (or
    ``large_bytes`` on paths matching ``large_paths``: model uploads), and answers 413 when
    there is more (whether ``Content-Length`` says so up front or a chunked body runs over);
    otherwise replays the body to the application."""

    def __init__(
        self, app: Any, max_bytes: int, large_paths: str = r"(?!)", large_bytes: int = 0
    ) -> None:
        self.app = app
        self.max_bytes, self.large_bytes = max_bytes, large_bytes
        self.large_paths = re.compile(large_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.large_bytes if self.large_paths.fullmatch(scope["path"]) else self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send, limit)
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
