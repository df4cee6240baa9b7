"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import sessionmaker

from service import lifecycle
from service.api import datasets, errors, keys, plans, runner
from service.api import jobs as jobs_api
from service.api.limits import BodyLimit
from service.auth import bootstrap_operator
from service.db import create_db_engine, upgrade
from service.orchestration import NullOrchestrator, Orchestrator
from service.settings import Settings

log = logging.getLogger(__name__)


def _poll(sessions: sessionmaker, orchestrator: Orchestrator) -> None:
    with sessions() as session:
        lifecycle.reconcile(session, orchestrator)


async def _keep_polling(
    sessions: sessionmaker, orchestrator: Orchestrator, interval: float
) -> None:
    """Settle jobs that end while nobody asks about them (no job stays "running" forever)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(_poll, sessions, orchestrator)
        except Exception:
            log.exception("polling the orchestrator failed; trying again")


def create_app(
    settings: Settings | None = None,
    orchestrator: Orchestrator | None = None,
    poll_interval: float | None = None,
) -> FastAPI:
    """Build the API. Without an ``orchestrator`` jobs are admitted and charged but never run
    (:class:`~service.orchestrator.NullOrchestrator`). With ``poll_interval`` the app asks the
    orchestrator about active jobs that often, and settles those that ended."""
    settings = settings or Settings()
    orchestrator = orchestrator or NullOrchestrator()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_path.mkdir(parents=True, exist_ok=True)
        engine = create_db_engine(settings.sqlalchemy_url)
        upgrade(engine)
        sessions = sessionmaker(engine, expire_on_commit=False)
        with sessions() as session:
            configured = settings.operator_key
            secret = bootstrap_operator(
                session, configured.get_secret_value() if configured else None
            )
            lifecycle.reconcile(session, orchestrator, startup=True)
        if secret is not None:
            print(f"dptune: created the operator key (shown once): {secret}", flush=True)
        app.state.settings = settings
        app.state.sessions = sessions
        app.state.orchestrator = orchestrator
        poller = (
            asyncio.create_task(_keep_polling(sessions, orchestrator, poll_interval))
            if poll_interval
            else None
        )
        yield
        if poller is not None:
            poller.cancel()
        engine.dispose()

    app = FastAPI(
        title="dptune",
        summary="Differentially private hyperparameter tuning with a per-dataset privacy budget",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        large_paths=runner.MODEL_UPLOAD_PATHS,
        large_bytes=settings.max_model_bytes,
    )
    errors.install(app)
    for router in (keys.router, datasets.router, plans.router, jobs_api.router, runner.router):
        app.include_router(router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
