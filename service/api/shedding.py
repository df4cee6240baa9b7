"""Load shedding: planning runs a few requests at a time, fairly between keys, and what does
not fit in its queue is refused at once (429 or 503, with ``Retry-After``) instead of waiting
inside the service for a thread, a database connection, the interpreter lock."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any

import anyio

from service.api.errors import ErrorOut

#: the requests that plan a job: ``POST /v1/plans`` and ``POST /v1/jobs`` (plan, then admit)
PLANNING = re.compile(r"/v1/(plans|jobs)/?")

#: OpenAPI declarations of the answers :class:`Planning` may give instead of the route's
RESPONSES: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorOut,
        "description": "This key has more planning requests waiting than its share: retry "
        "after `Retry-After` seconds.",
    },
    503: {
        "model": ErrorOut,
        "description": "The service is full (the planning queue), or a dependency (the Ray "
        "cluster) does not answer; nothing was changed. Retry after `Retry-After` seconds.",
    },
}


class Planning:
    """Pure ASGI middleware in front of the planning routes (:data:`PLANNING`): at most
    ``workers`` of them inside the application at once, at most ``per_key`` of those for one
    key (the bearer credential, hashed: shedding needs no database), the others waiting here
    on the event loop, up to ``queue`` of them, holding no thread, connection or request slot
    of :class:`~service.api.limits.InFlight`. So budget reads and the other routes never wait
    behind planning, which is CPU-bound and would otherwise take every worker thread and,
    through the interpreter lock, their time.

    A request that finds the queue full is refused, nothing done: 429 when its key holds at
    least its share of the pool (its size over the keys in it), else 503 — the service is
    full with others' work. Both say ``Retry-After: retry_after_s``."""

    def __init__(
        self, app: Any, workers: int, per_key: int, queue: int, retry_after_s: int
    ) -> None:
        self.app = app
        self.workers, self.per_key, self.queue = workers, per_key, queue
        self.retry_after_s = retry_after_s
        self.held: Counter[bytes] = Counter()  # requests in the pool (waiting or planning)
        self.gate = anyio.Semaphore(workers)
        self.keys: dict[bytes, anyio.Semaphore] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not PLANNING.fullmatch(scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        key = _credential(scope)
        size = sum(self.held.values())
        if size >= self.workers + self.queue:
            keys = len(self.held) + (key not in self.held)
            await self._refuse(send, self.held[key] * keys >= size)
            return
        self.held[key] += 1
        try:
            async with self._key_gate(key), self.gate:
                await self.app(scope, receive, send)
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key], self.keys[key]

    def _key_gate(self, key: bytes) -> anyio.Semaphore:
        if key not in self.keys:
            self.keys[key] = anyio.Semaphore(self.per_key)
        return self.keys[key]

    async def _refuse(self, send: Any, over_share: bool) -> None:
        if over_share:
            status, detail = 429, "this key has more plans waiting than its share: retry later"
        else:
            status, detail = 503, "the service is planning as many jobs as it can: retry later"
        body = json.dumps({"detail": detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _credential(scope: dict[str, Any]) -> bytes:
    """Whom a request counts against: a digest of its ``Authorization`` header (unchecked
    here; the route answers 401 to a wrong one)."""
    header = dict(scope["headers"]).get(b"authorization", b"")
    return hashlib.sha256(header).digest()
