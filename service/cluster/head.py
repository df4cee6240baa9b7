"""Connecting to Ray: an existing cluster (``DPTUNE_RAY_ADDRESS``) or a local head started here.

Ray 2.60 turns token authentication on for new local clusters. We keep it on: the token lives
in ``<data dir>/ray/auth_token`` (created once, mode 0600) unless ``RAY_AUTH_TOKEN`` /
``RAY_AUTH_TOKEN_PATH`` name one, the local head is started with it, and every Jobs API call
sends it as ``Authorization: Bearer``. Only the test suite sets ``RAY_AUTH_MODE=disabled``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

DASHBOARD_HOST = "127.0.0.1"


@dataclass(frozen=True)
class RayConnection:
    """Where the Jobs API is and how to authenticate to it."""

    dashboard_url: str
    token: str | None
    started_here: bool

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def stop(self) -> None:
        """Stop the local head if this process started it (``ray stop``)."""
        if self.started_here:
            subprocess.run([_ray_cli(), "stop"], check=False, capture_output=True, timeout=120)


def _ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def auth_enabled() -> bool:
    return os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled"


def ensure_token(data_dir: Path) -> str:
    """The Ray token: ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``, or one created
    once under the data dir. Exported so that Ray (and the processes it starts) use it."""
    if token := os.environ.get("RAY_AUTH_TOKEN"):
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", data_dir / "ray" / "auth_token"))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    return path.read_text().strip()


def _jobs_api_up(connection: RayConnection) -> bool:
    try:
        url = f"{connection.dashboard_url}/api/jobs/"
        return httpx.get(url, headers=connection.headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _start_head(dashboard_port: int, num_cpus: int | None, num_gpus: int | None) -> None:
    cmd = [
        _ray_cli(),
        "start",
        "--head",
        f"--dashboard-host={DASHBOARD_HOST}",
        f"--dashboard-port={dashboard_port}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    log.info("starting a local Ray head: %s", " ".join(cmd))
    # Ray's processes (and so every trial) inherit the head's environment: keep the service's
    # own settings — the operator key, the database URL — out of it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"could not start a local Ray head:\n{done.stderr[-2000:]}")


def connect(
    data_dir: Path,
    address: str | None = None,
    dashboard_port: int = 8265,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout_s: float = 120,
) -> RayConnection:
    """Connect to the Ray cluster whose dashboard is at ``address`` (e.g.
    ``http://head:8265``) or, when it is None, to the local head on ``dashboard_port``,
    starting one if none answers."""
    token = ensure_token(data_dir) if auth_enabled() else None
    existing = RayConnection(
        address or f"http://{DASHBOARD_HOST}:{dashboard_port}", token, started_here=False
    )
    if address is not None or _jobs_api_up(existing):
        return existing
    _start_head(dashboard_port, num_cpus, num_gpus)
    deadline = time.monotonic() + timeout_s
    while not _jobs_api_up(existing):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the Ray Jobs API at {existing.dashboard_url} did not come up in {timeout_s:.0f} s"
            )
        time.sleep(0.5)
    return RayConnection(existing.dashboard_url, token, started_here=True)
