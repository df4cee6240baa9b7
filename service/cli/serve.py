"""``dptune serve``: run the API with uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn

from service.api import create_app


def serve(
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
) -> None:
    """Start the HTTP API (settings from DPTUNE_* environment variables)."""
    uvicorn.run(create_app(), host=host, port=port)
