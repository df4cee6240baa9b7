"""``dptune serve`` is a Typer command with the embedded defaults."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from service.cli.serve import serve
from service.orchestration import NullOrchestrator


def test_serve_command(monkeypatch):
    calls, control = [], []

    def orchestrator(settings, control_url):
        control.append(control_url)  # where jobs' runners will call back
        return NullOrchestrator(dashboard_url="http://ray:8265")

    monkeypatch.setattr("service.cli.serve.ray_orchestrator", orchestrator)
    monkeypatch.setattr(
        "service.cli.serve.run",
        lambda app, host, port: calls.append((type(app).__name__, host, port)),
    )
    app = typer.Typer()
    app.command()(serve)
    runner = CliRunner()
    assert "--port" in runner.invoke(app, ["--help"]).output
    assert runner.invoke(app, []).exit_code == 0
    assert runner.invoke(app, ["--host", "0.0.0.0", "--port", "9000"]).exit_code == 0
    assert calls == [("FastAPI", "127.0.0.1", 8000), ("FastAPI", "0.0.0.0", 9000)]
    assert control == ["http://127.0.0.1:8000", "http://0.0.0.0:9000"]
