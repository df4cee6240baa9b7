"""``dptune demo`` end to end as a user runs it (a subprocess), on a Ray head of its own beside
the session's, which it leaves running (issue 42)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from service.cluster.head import head_processes, load_record, probe

DPTUNE = str(Path(sys.executable).parent / "dptune")


def run_demo(data_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_")}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [DPTUNE, "demo", "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_demo_runs_both_jobs_on_its_own_head_beside_another(ray_head, tmp_path) -> None:
    data_dir = tmp_path / "demo"
    result = run_demo(data_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("— released") == 2
    own = load_record(tmp_path / "demo-state")
    assert own is not None and own.dashboard_url in result.stdout
    assert "remaining" in result.stdout and ray_head.dashboard_url not in result.stdout
    assert not head_processes(own)  # its head stopped, by its own process ids
    assert probe(ray_head) is None  # the other head still answers
    shutil.rmtree(own.temp_dir)  # its Ray logs
    for job in (1, 2):
        with safe_open(str(data_dir / "models" / f"job-{job}.safetensors"), "pt") as f:
            assert "config" in f.metadata()


def test_demo_refuses_to_wipe_a_foreign_directory(tmp_path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    result = run_demo(tmp_path)
    assert result.returncode != 0 and "--data-dir" in result.stdout + result.stderr
    assert (tmp_path / "precious.txt").exists()
