"""``dptune serve``: run the API with uvicorn, its jobs on Ray."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn

from service.api import create_app
from service.cluster import ray_orchestrator
from service.settings import Settings


def serve(
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
) -> None:
    """Start the HTTP API (settings from DPTUNE_* environment variables). Jobs run on the Ray
    cluster at DPTUNE_RAY_ADDRESS, or on a local Ray head started on first use."""
    settings = Settings()
    orchestrator = ray_orchestrator(settings, f"http://{host}:{port}")
    typer.echo(f"dptune: Ray dashboard at {orchestrator.dashboard_url}")
    uvicorn.run(create_app(settings, orchestrator, settings.poll_interval_s), host=host, port=port)
