"""``dptune serve`` is a Typer command with the embedded defaults; it and ``dptune db`` keep
the database in the state dir, apart from the data dir that Ray jobs receive."""

from __future__ import annotations

import subprocess
import sys

import typer
from typer.testing import CliRunner

from service.cli import app as cli
from service.cli.serve import serve
from service.cluster.head import own_record
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


def test_ray_status_and_stop_manage_the_head_the_data_dir_owns(tmp_path):
    """``dptune ray status`` names the recorded dashboard, ports and the head's process ids;
    ``dptune ray stop`` ends those processes (a stand-in naming the head's temp dir) alone."""
    env = {"RAY_AUTH_MODE": "disabled", "DPTUNE_DATA_DIR": str(tmp_path / "data")}
    runner = CliRunner()
    never = runner.invoke(cli, ["ray", "status"], env=env)
    assert never.exit_code == 3 and "never started" in never.output
    record = own_record(tmp_path / "data-state")
    marker = f"--temp-dir={record.temp_dir}"
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker + "0"])
    try:
        up = runner.invoke(cli, ["ray", "status", "--data-dir", str(tmp_path / "data")], env=env)
        assert up.exit_code == 0, up.output
        assert f"pids: {ours.pid}\n" in up.output and record.dashboard_url in up.output
        assert f"gcs {record.gcs_port}" in up.output and "not answering" in up.output
        stopped = runner.invoke(cli, ["ray", "stop"], env=env)
        assert stopped.exit_code == 0 and "(1 processes)" in stopped.output
        assert ours.wait(timeout=10) is not None and other.poll() is None
        down = runner.invoke(cli, ["ray", "status"], env=env)
        assert down.exit_code == 3 and "state: down" in down.output
        assert "no local Ray head" in runner.invoke(cli, ["ray", "stop"], env=env).output
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()
