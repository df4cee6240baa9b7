"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from service import lifecycle
from service.api import datasets, errors, heap, keys, logs, plans, runner
from service.api import jobs as jobs_api
from service.api.limits import BodyLimit, InFlight
from service.api.shedding import Planning
from service.auth import bootstrap_operator
from service.db import create_db_engine, ensure_schema
from service.db.engine import POOL_SIZE
from service.orchestration import NullOrchestrator, Orchestrator, OrchestratorUnavailable
from service.settings import Settings

log = logging.getLogger(__name__)


class RayHealth(BaseModel):
    reachable: bool | None  # None: not asked yet (the first poll has not ended, or no poller)
    error: str | None = None  # why not, in one line that names no address


class Health(BaseModel):
    """``/healthz``. HTTP 200 whenever the service answers — it serves budgets, datasets,
    keys, plans and job reads while Ray is down, so a liveness or readiness probe should not
    restart or drop it then. ``status``: "degraded" while a dependency does not answer (the
    database, or the Ray Jobs API as last polled); "starting" while the database answers and
    the service has not heard from Ray yet (its first poll, which may start a local head, has
    not ended); else "ok"."""

    status: Literal["ok", "starting", "degraded"]
    database: Literal["ok", "unreachable"]
    ray: RayHealth


@dataclass
class Reachability:
    """What the poller last learned of the orchestrator. ``last_answer`` starts at the
    service's start: a cluster that has not answered since counts as silent since then."""

    reachable: bool | None = None
    error: str | None = None
    last_answer: float = field(default_factory=time.monotonic)

    def answered(self) -> None:
        if self.reachable is False:
            log.warning("the Ray Jobs API answers again")
        self.reachable, self.error = True, None
        self.last_answer = time.monotonic()

    def unanswered(self, error: str) -> float:
        """Record that it did not answer; return for how long it has not (in seconds)."""
        if self.reachable is not False or error != self.error:
            log.warning(
                "Ray does not answer (%s): serving degraded, jobs are queued until it does", error
            )
        self.reachable, self.error = False, error
        return time.monotonic() - self.last_answer


def _poll(
    sessions: sessionmaker, orchestrator: Orchestrator, seen: Reachability, give_up_s: float
) -> None:
    """One round: is the orchestrator there? Then settle the jobs that ended and hand over the
    jobs still queued. While it does not answer nothing is settled (unknown is not lost) —
    until ``give_up_s`` have passed without an answer: then the jobs it was running are
    failed (:func:`service.lifecycle.abandon`)."""
    try:
        orchestrator.check()
    except OrchestratorUnavailable as error:
        silent_s = seen.unanswered(str(error))
        if silent_s > give_up_s:
            with sessions() as session:
                lifecycle.abandon(
                    session,
                    f"the Ray cluster has not answered for {silent_s:.0f} s "
                    "(DPTUNE_RAY_GIVE_UP_S): failed, charged the trial attempts it recorded",
                )
        return
    seen.answered()
    with sessions() as session:
        lifecycle.reconcile(session, orchestrator)
        lifecycle.submit_pending(session, orchestrator)


async def _keep_polling(poll: Callable[[], None], interval: float) -> None:
    """Poll now and every ``interval`` s, so that jobs that end are settled and queued jobs
    handed over while nobody asks (no job stays "running" forever). A failing round is one log
    line, repeated only when the failure changes; the next round tries again."""
    failing: str | None = None
    while True:
        try:
            await run_in_threadpool(poll)
            failing = None
        except Exception as error:
            line = f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"
            if line != failing:
                log.warning("polling failed, trying again every %g s: %s", interval, line)
            failing = line
        await asyncio.sleep(interval)


def _database(sessions: sessionmaker) -> Literal["ok", "unreachable"]:
    try:
        with sessions() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return "unreachable"
    return "ok"


def create_app(
    settings: Settings | None = None,
    orchestrator: Orchestrator | None = None,
    poll_interval: float | None = None,
) -> FastAPI:
    """Build the API. Without an ``orchestrator`` jobs are admitted and charged but never run
    (:class:`~service.orchestrator.NullOrchestrator`). With ``poll_interval`` the app asks the
    orchestrator about active jobs at start and that often after, settles those that ended
    (while the service was down, too) and hands over those admitted while it did not answer
    (:func:`_poll`). Start-up itself does not wait for the orchestrator.

    While it serves, the objects that exist once it has started are kept out of Python's
    cyclic garbage collection (:mod:`service.api.heap`); the shutdown gives them back."""
    settings = settings or Settings()
    orchestrator = orchestrator or NullOrchestrator()
    seen = Reachability()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.prepare_dirs()
        engine = create_db_engine(settings.sqlalchemy_url)
        ensure_schema(engine, settings.auto_upgrade)
        sessions = sessionmaker(engine, expire_on_commit=False)
        with sessions() as session:
            configured = settings.operator_key
            secret = bootstrap_operator(
                session, configured.get_secret_value() if configured else None
            )
        if secret is not None:
            print(f"dptune: created the operator key (shown once): {secret}", flush=True)
        app.state.settings = settings
        app.state.sessions = sessions
        app.state.orchestrator = orchestrator
        poll = partial(_poll, sessions, orchestrator, seen, settings.ray_give_up_s)
        poller = asyncio.create_task(_keep_polling(poll, poll_interval)) if poll_interval else None
        try:
            with heap.frozen():
                yield
        finally:
            if poller is not None:
                poller.cancel()
            engine.dispose()

    app = FastAPIOffline(  # /docs and /redoc load their scripts from the package, not a CDN
        title="dptune",
        summary="Differentially private hyperparameter tuning with a per-dataset privacy budget",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.add_middleware(InFlight, limit=POOL_SIZE)  # inside BodyLimit: bodies are read first
    app.add_middleware(  # outside InFlight: waiting plans hold no request slot
        Planning,
        workers=settings.planning_workers,
        per_key=settings.planning_per_key,
        queue=settings.planning_queue,
        retry_after_s=settings.retry_after_s,
    )
    app.add_middleware(
        BodyLimit,
        max_depth=settings.max_json_depth,
        max_bytes=settings.max_body_bytes,
        large_paths=runner.MODEL_UPLOAD_PATHS,
        large_bytes=settings.max_model_bytes,
        streamed_paths=datasets.UPLOAD_PATHS,
        streamed_bytes=settings.max_upload_bytes,
    )
    errors.install(app)
    for router in (keys.router, datasets.router, plans.router, jobs_api.router, runner.router):
        app.include_router(router)
    app.include_router(logs.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> Health:
        database = _database(app.state.sessions)
        if database != "ok" or seen.reachable is False:
            state: Literal["ok", "starting", "degraded"] = "degraded"
        else:
            state = "starting" if poll_interval and seen.reachable is None else "ok"
        return Health(
            status=state,
            database=database,
            ray=RayHealth(reachable=seen.reachable, error=seen.error),
        )

    return app
