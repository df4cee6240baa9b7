"""Serving the API from a background thread: ``dptune demo`` and the end-to-end tests run
the service in-process while Ray jobs' runners call its internal API over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BackgroundServer(threading.Thread):
    """``with BackgroundServer(app, port):`` serves ``app`` on 127.0.0.1:``port`` (lifespan
    included) until the block ends."""

    def __init__(self, app: Any, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )

    def run(self) -> None:
        self.server.run()

    def __enter__(self) -> BackgroundServer:
        self.start()
        while not self.server.started:
            if not self.is_alive():
                raise RuntimeError(f"the API did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.join(timeout=30)
