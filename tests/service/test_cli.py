"""``dptune serve`` is a Typer command with the embedded defaults; it and ``dptune db`` keep
the database in the state dir, apart from the data dir that Ray jobs receive."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from service.cli import app as cli
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


def test_serve_refuses_a_state_dir_inside_the_data_dir_in_one_line(tmp_path):
    env = {
        "RAY_AUTH_MODE": "disabled",
        "DPTUNE_DATA_DIR": str(tmp_path / "data"),
        "DPTUNE_STATE_DIR": str(tmp_path / "data" / "state"),
    }
    app = typer.Typer()
    app.command()(serve)
    result = CliRunner().invoke(app, [], env=env)
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and "DPTUNE_STATE_DIR" in line and "DPTUNE_DATA_DIR" in line
    assert not (tmp_path / "data").exists()  # refused before anything was made


def test_db_commands_keep_the_database_in_the_state_dir(tmp_path):
    env = {"DPTUNE_DATA_DIR": str(tmp_path / "data"), "DPTUNE_DATABASE_URL": ""}
    runner = CliRunner()
    assert runner.invoke(cli, ["db", "upgrade"], env=env).exit_code == 0
    assert runner.invoke(cli, ["db", "current"], env=env).output.endswith("(current)\n")
    assert (tmp_path / "data-state" / "dptune.db").stat().st_size > 0
    assert not any((tmp_path / "data").iterdir())
