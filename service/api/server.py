"""Serving the API with uvicorn, its connections guarded (:class:`EdgeProtocol`): ``dptune
serve`` (:func:`serve`), and a background thread (:class:`BackgroundServer`) in which
``dptune demo`` and the end-to-end tests run the service in-process while Ray jobs' runners
call its internal API over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
import threading
import time
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.settings import Settings

#: states of a connection whose client has not sent its whole request (or sent none yet)
_READING = (h11.IDLE, h11.SEND_BODY)


class EdgeProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11), with the guards it lacks against clients that hold
    connections without finishing requests (slowloris, slow bodies, idle sockets): a request
    head must arrive whole within ``settings.header_timeout_s`` of the connection, or of its
    first byte after a response; a body may go ``settings.body_timeout_s`` without a byte; a
    connection past ``settings.max_connections`` closes the one that has been quiet longest
    among those not waiting for a response. Each of these closes the connection. Subclassed
    per service by :func:`protocol` (uvicorn makes the protocol from its class)."""

    settings: ClassVar[Settings]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.quiet_since = self.loop.time()
        self.deadline: asyncio.TimerHandle | None = None
        self._expect(self.settings.header_timeout_s)
        self._reap()

    def data_received(self, data: bytes) -> None:
        self.quiet_since = self.loop.time()
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            self._expect(self.settings.body_timeout_s)
        elif self.conn.their_state is h11.IDLE:
            if self.deadline is None:  # the first bytes of a request on a kept-alive connection
                self._expect(self.settings.header_timeout_s)
        else:
            self._expect(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._expect(None)  # from here, uvicorn's keep-alive timeout
        super().on_response_complete()

    def _expect(self, seconds: float | None) -> None:
        """Close the connection in ``seconds`` unless :meth:`data_received` moves the deadline
        (None: no deadline)."""
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None if seconds is None else self.loop.call_later(seconds, self._close)

    def _close(self) -> None:
        self.deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _reap(self) -> None:
        open_ = [
            c
            for c in self.connections
            if isinstance(c, EdgeProtocol) and not c.transport.is_closing()
        ]
        if len(open_) > self.settings.max_connections:
            reapable = (c for c in open_ if c.conn.their_state in _READING)  # self, at least
            min(reapable, key=lambda c: c.quiet_since)._close()


def protocol(settings: Settings) -> type[EdgeProtocol]:
    """:class:`EdgeProtocol` with ``settings``' limits."""
    return type("Edge", (EdgeProtocol,), {"settings": settings})


def config(app: Any, settings: Settings, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for the API: the guarded protocol, ``settings``' keep-alive."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol(settings),
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]  # call_later
        **options,
    )


SWITCH_INTERVAL_S = 0.001
"""How long a thread may hold the interpreter lock while another waits for it
(:func:`sys.setswitchinterval`; Python's default is 5 ms). A request passes it between the
event loop and worker threads several times, and while a plan computes in a worker thread
each pass may wait the whole interval: budget reads would wait behind planning."""


def prepare_process() -> int:
    """Make this process fit to serve: its open-file limit (each connection takes one) raised
    to the hard limit, which a process may do unprivileged, and the interpreter lock passed
    on sooner (:data:`SWITCH_INTERVAL_S`). Returns the open-file limit."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def serve(app: Any, host: str, port: int) -> None:
    """Serve ``app`` with uvicorn until interrupted (``dptune serve``), entering its lifespan
    first: a start-up failure (a :class:`~service.settings.StartupError` about the database)
    then reaches the caller as an exception before anything listens — uvicorn itself would log
    it as a traceback. Connections are guarded by the app's settings (:func:`config`), and
    the process prepared (:func:`prepare_process`)."""

    async def main() -> None:
        async with app.router.lifespan_context(app):
            settings = app.state.settings
            files = prepare_process()
            if files < settings.max_connections + 100:  # the database's, Ray's, logs
                print(
                    f"dptune: warning: {files} open files allowed (ulimit -n) for "
                    f"DPTUNE_MAX_CONNECTIONS={settings.max_connections}",
                    file=sys.stderr,
                )
            await uvicorn.Server(config(app, settings, host, port, lifespan="off")).serve()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BackgroundServer(threading.Thread):
    """``with BackgroundServer(app, port):`` serves ``app`` on 127.0.0.1:``port`` (lifespan
    included) until the block ends, its connections guarded by ``settings``' limits (default:
    from the environment)."""

    def __init__(self, app: Any, port: int, settings: Settings | None = None) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}"
        options = {"log_level": "warning"}
        self.server = uvicorn.Server(
            config(app, settings or Settings(), "127.0.0.1", port, **options)
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
