"""The local Ray head is its data directory's own (issue 42), on a real Ray: two data dirs give
two heads beside a foreign cluster, each stopped alone — ``dptune ray stop`` included — and
nothing in the repository runs ``ray stop``, which ends every Ray cluster of the user.

Run under ``flock /tmp/dptune-ray.lock`` on a shared machine: each test starts Ray heads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from service.cluster.head import RayConnection, connect, head_processes, probe, stop_head

from .cluster import local_cluster

DPTUNE = str(Path(sys.executable).parent / "dptune")
ROOT = Path(__file__).parents[2]


def dptune_ray(verb: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DPTUNE, "ray", verb, "--data-dir", str(data_dir)],
        env={k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def answers(connection: RayConnection) -> bool:
    return probe(connection, timeout_s=10) is None


def default_cluster() -> tuple[float, str] | None:
    """Ray's record of the cluster ``ray.init()`` joins by default, which no dptune head may
    take over: its time and content."""
    path = Path("/tmp/ray/ray_current_cluster")
    return (path.stat().st_mtime, path.read_text()) if path.exists() else None


def test_two_data_dirs_run_two_heads_beside_a_foreign_cluster_and_each_stops_alone(
    tmp_path: Path,
) -> None:
    default = default_cluster()
    with local_cluster() as foreign:
        foreign.start_head(num_cpus=1)
        heads: list[RayConnection] = []
        try:
            for name in ("a", "b"):
                heads.append(connect(tmp_path / f"{name}-state", num_cpus=1, num_gpus=0))
            a, b = heads
            assert a.record is not None and b.record is not None
            assert a.record.temp_dir != b.record.temp_dir
            assert not set(a.record.listening_ports().values()) & set(
                b.record.listening_ports().values()
            )
            assert all(map(answers, (a, b, foreign.connection)))
            assert default_cluster() == default

            status = dptune_ray("status", tmp_path / "b")
            assert status.returncode == 0, status.stdout + status.stderr
            assert "state: up" in status.stdout and b.dashboard_url in status.stdout

            a.stop()
            assert not answers(a) and not head_processes(a.record)
            assert answers(b) and answers(foreign.connection)

            stopped = dptune_ray("stop", tmp_path / "b")
            assert stopped.returncode == 0 and "stopped the local Ray head" in stopped.stdout
            assert not answers(b) and not head_processes(b.record)
            assert answers(foreign.connection) and all(n.processes() for n in foreign.nodes)
            assert dptune_ray("status", tmp_path / "b").returncode == 3
        finally:
            for connection in heads:
                assert connection.record is not None
                stop_head(connection.record)
                shutil.rmtree(connection.record.temp_dir, ignore_errors=True)


#: Ray's own stop command: on a command line or in docs, or as a subprocess's arguments — not
#: dptune's (``dptune ray stop``, ``invoke(cli, ["ray", "stop"])``)
RAY_STOP = re.compile(
    r"(?<!dptune )\bray\s+stop\b"
    r"|(?<!cli, \[)[\"']ray[\"']\s*,\s*[\"']stop[\"']"
    r"|_ray_cli\(\)\s*,\s*[\"']stop[\"']"
)
#: prose that warns against it
WARNING = re.compile(r"\b(never|not|kills every|ends every|stops every)\b", re.IGNORECASE)


def test_nothing_in_the_repository_runs_ray_stop() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = []
    for name in listed:
        path = ROOT / name
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):  # removed meanwhile, or binary
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if RAY_STOP.search(line) and not WARNING.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
