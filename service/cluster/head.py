"""Connecting to Ray: an existing cluster (``DPTUNE_RAY_ADDRESS``) or a local head started here.

``dptune serve`` does not wait for Ray: it starts with its cluster down and keeps trying in the
background (:class:`LocalHead`, :func:`probe`), so budgets and jobs can be read meanwhile.

Ray 2.60 turns token authentication on for new local clusters. We keep it on: the token lives
in ``<state dir>/ray-auth-token`` (created once, mode 0600) unless ``RAY_AUTH_TOKEN`` /
``RAY_AUTH_TOKEN_PATH`` name one, the local head is started with it, and every Jobs API call
sends it as ``Authorization: Bearer``. Only the test suite sets ``RAY_AUTH_MODE=disabled``.
Every Ray process, trials included, holds the token (Ray's workers authenticate with it); none
is told where the state dir is (invariant 16).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.orchestration import OrchestratorUnavailable
from service.settings import RAY_TOKEN_FILE, private_dir, private_file

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
            _ray_stop()


def _ray_stop() -> None:
    subprocess.run([_ray_cli(), "stop"], check=False, capture_output=True, timeout=120)


def _ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def auth_enabled() -> bool:
    return os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled"


def ensure_token(state_dir: Path) -> str:
    """The Ray token: ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``, or one created
    once in the state dir. Exported as ``RAY_AUTH_TOKEN`` so that Ray (and the processes it
    starts: a local head, its trials) use it by value, never learning the state dir's path."""
    if token := os.environ.get("RAY_AUTH_TOKEN"):
        return token
    configured = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(configured) if configured else private_dir(state_dir) / RAY_TOKEN_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        private_file(path).write_text(secrets.token_hex(32))
    token = path.read_text().strip()
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    return token


def probe(connection: RayConnection, timeout_s: float = 5) -> str | None:
    """None when the Jobs API at ``connection`` answers (token included), else why not, in one
    line that names no address: it is shown on the unauthenticated ``/healthz``."""
    try:
        url = f"{connection.dashboard_url}/api/version"
        response = httpx.get(url, headers=connection.headers, timeout=timeout_s)
    except httpx.HTTPError as error:
        return f"no answer from the Ray Jobs API ({type(error).__name__})"
    if response.status_code in (401, 403):
        return "the Ray Jobs API refused the Ray auth token"
    if response.status_code != 200:
        return f"the Ray Jobs API answered HTTP {response.status_code}"
    return None


def _start_head(
    dashboard_port: int, num_cpus: int | None, num_gpus: int | None, cwd: Path | None = None
) -> None:
    """``ray start --head``. Its processes — every job's driver, every trial — inherit its
    environment and its working directory ``cwd`` (the data dir, not the service's own, which
    may hold the state dir)."""
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
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=cwd
    )
    if done.returncode != 0:
        raise RuntimeError(f"could not start a local Ray head:\n{done.stderr[-2000:]}")


def _wait_until_up(connection: RayConnection, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while probe(connection) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the Ray Jobs API at {connection.dashboard_url} did not come up in "
                f"{timeout_s:.0f} s"
            )
        time.sleep(0.5)


def connection_to(state_dir: Path, address: str | None, dashboard_port: int) -> RayConnection:
    """The Jobs API of the cluster at ``address`` or of the local head on ``dashboard_port``,
    with the token to send it (:func:`ensure_token`); nothing is contacted."""
    token = ensure_token(state_dir) if auth_enabled() else None
    return RayConnection(
        address or f"http://{DASHBOARD_HOST}:{dashboard_port}", token, started_here=False
    )


def connect(
    state_dir: Path,
    address: str | None = None,
    dashboard_port: int = 8265,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout_s: float = 120,
) -> RayConnection:
    """Connect to the Ray cluster whose dashboard is at ``address`` (e.g.
    ``http://head:8265``) or, when it is None, to the local head on ``dashboard_port``,
    starting one if none answers (and waiting for it)."""
    existing = connection_to(state_dir, address, dashboard_port)
    if address is not None or probe(existing) is None:
        return existing
    _start_head(dashboard_port, num_cpus, num_gpus)
    _wait_until_up(existing, timeout_s)
    return RayConnection(existing.dashboard_url, existing.token, started_here=True)


_COULD_NOT_START = "could not start the local Ray head (the service log says why)"


@dataclass
class LocalHead:
    """The local head of the embedded default (no ``DPTUNE_RAY_ADDRESS``), started whenever
    its Jobs API does not answer — at start, and again in the background should it fail to
    start or stop later — at most once per ``retry_s``, so that a head that cannot start
    (a port taken, Ray missing) costs one try, and one log line, per interval."""

    dashboard_port: int
    num_cpus: int | None = None
    num_gpus: int | None = None
    cwd: Path | None = None  # the data dir: jobs' drivers start there
    retry_s: float = 30.0
    timeout_s: float = 120.0
    started: bool = field(default=False, init=False)
    _next_try: float = field(default=0.0, init=False)

    def start(self, connection: RayConnection) -> None:
        """Start the head behind ``connection`` and wait for its Jobs API; raise
        :class:`OrchestratorUnavailable` (why goes to the log) when it cannot, or when the
        last try was less than ``retry_s`` ago."""
        if time.monotonic() < self._next_try:
            raise OrchestratorUnavailable(_COULD_NOT_START)
        self._next_try = time.monotonic() + self.retry_s
        try:
            _start_head(self.dashboard_port, self.num_cpus, self.num_gpus, self.cwd)
            self.started = True
            _wait_until_up(connection, self.timeout_s)
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            why = " ".join(str(error).split())[-500:]
            log.warning(
                "could not start a local Ray head (retrying in %.0f s): %s", self.retry_s, why
            )
            raise OrchestratorUnavailable(_COULD_NOT_START) from None

    def stop(self) -> None:
        """Stop the head if this process started it (``ray stop``)."""
        if self.started:
            _ray_stop()
