"""``dptune serve``: run the API with uvicorn, its jobs on Ray."""

from __future__ import annotations

from typing import Annotated

import typer
from fastapi import FastAPI
from pydantic import ValidationError

from service.api import create_app, server
from service.cluster import ray_orchestrator
from service.settings import Settings, StartupError


def serve(
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
) -> None:
    """Start the HTTP API (settings from DPTUNE_* environment variables). Jobs run on the Ray
    cluster at DPTUNE_RAY_ADDRESS, or on a local Ray head started when none answers. The API
    does not wait for Ray: while it does not answer the service runs degraded (GET /healthz),
    jobs are queued, and it keeps trying in the background."""
    try:
        settings = Settings()
        orchestrator = ray_orchestrator(settings, f"http://{host}:{port}")
        typer.echo(f"dptune: Ray dashboard at {orchestrator.dashboard_url}")
        run(create_app(settings, orchestrator, settings.poll_interval_s), host, port)
    except ValidationError as error:
        typer.echo(settings_error(error), err=True)
        raise typer.Exit(1) from None
    except StartupError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1) from None


def settings_error(error: ValidationError) -> str:
    """One line naming each bad ``DPTUNE_*`` variable and what is wrong with it — never its
    value, which may be a secret (the operator key)."""
    problems = (
        f"DPTUNE_{'_'.join(str(part) for part in e['loc']).upper()}: {e['msg']}"
        for e in error.errors()
    )
    return f"dptune: invalid setting {'; '.join(problems)}"


def run(app: FastAPI, host: str, port: int) -> None:
    """Serve ``app`` (:func:`service.api.server.serve`)."""
    server.serve(app, host, port)
