"""``dptune demo`` end to end as a user runs it (a subprocess), on the session's Ray head."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from .conftest import TEST_DASHBOARD_PORT

DPTUNE = str(Path(sys.executable).parent / "dptune")


def run_demo(data_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DPTUNE_RAY_DASHBOARD_PORT": str(TEST_DASHBOARD_PORT), "COLUMNS": "200"}
    return subprocess.run(
        [DPTUNE, "demo", "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_demo_runs_both_jobs_and_releases_their_models(ray_head, tmp_path) -> None:
    data_dir = tmp_path / "demo"
    result = run_demo(data_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("— released") == 2
    assert "remaining" in result.stdout and ray_head.dashboard_url in result.stdout
    for job in (1, 2):
        with safe_open(str(data_dir / "models" / f"job-{job}.safetensors"), "pt") as f:
            assert "config" in f.metadata()


def test_demo_refuses_to_wipe_a_foreign_directory(tmp_path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    result = run_demo(tmp_path)
    assert result.returncode != 0 and "--data-dir" in result.stdout + result.stderr
    assert (tmp_path / "precious.txt").exists()
