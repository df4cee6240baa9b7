"""``dptune ray status|stop``: the local Ray head a data directory owns (its state dir records
the head's temp dir and ports, :mod:`service.cluster.head`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from service.cluster.head import (
    HEAD_FILE,
    HeadRecord,
    RayConnection,
    auth_enabled,
    ensure_token,
    head_processes,
    load_record,
    probe,
    stop_head,
)
from service.settings import Settings

app = typer.Typer(no_args_is_help=True, help="The local Ray head this data directory owns.")

DataDir = Annotated[
    Path | None,
    typer.Option(help="The data directory (default: DPTUNE_DATA_DIR, ./.dptune)."),
]
NOT_RUNNING = 3
"""Exit status of ``status`` when the head does not run (as ``systemctl status``)."""


def _head(data_dir: Path | None) -> tuple[Settings, HeadRecord | None]:
    settings = Settings(data_dir=data_dir) if data_dir else Settings()
    return settings, load_record(settings.state_path)


def _describe(record: HeadRecord, pids: list[int], reason: str | None) -> list[str]:
    state = "up" if pids and reason is None else f"not answering ({reason})" if pids else "down"
    ports = ", ".join(
        f"{name.removesuffix('_port').replace('_', ' ')} {port}"
        for name, port in record.listening_ports().items()
    )
    return [
        f"state: {state}",
        f"dashboard: {record.dashboard_url}",
        f"GCS address: {record.gcs_address}",
        f"temp dir: {record.temp_dir}",
        f"ports: {ports}; workers {record.min_worker_port}-{record.max_worker_port}",
        f"pids: {' '.join(map(str, pids)) or '-'}",
    ]


def status(data_dir: DataDir = None) -> None:
    """Say whether the local Ray head of the data directory runs and answers, its dashboard
    URL, ports and process ids; exit status 3 when it does not run."""
    settings, record = _head(data_dir)
    typer.echo(f"local Ray head of {settings.data_path}")
    if settings.ray_address:
        typer.echo(f"(DPTUNE_RAY_ADDRESS is set: dptune serve uses {settings.ray_address})")
    if record is None:
        typer.echo(f"state: never started (no {HEAD_FILE} in {settings.state_path})")
        raise typer.Exit(NOT_RUNNING)
    pids = sorted(p.pid for p in head_processes(record))
    token = ensure_token(settings.state_path) if auth_enabled() else None
    reason = probe(RayConnection(record.dashboard_url, token, started_here=False))
    for line in _describe(record, pids, reason):
        typer.echo(line)
    if not pids:
        raise typer.Exit(NOT_RUNNING)


def stop(data_dir: DataDir = None) -> None:
    """Stop the local Ray head of the data directory by its process ids — no other Ray
    cluster is touched. Jobs still running on it end with it."""
    settings, record = _head(data_dir)
    stopped = stop_head(record) if record else []
    if stopped:
        typer.echo(f"stopped the local Ray head of {settings.data_path} ({len(stopped)} processes)")
    else:
        typer.echo(f"no local Ray head of {settings.data_path} runs")


app.command()(status)
app.command()(stop)
