"""The control plane and a Ray head that comes and goes, on a real Ray (issue 13): the service
starts with no head at its ``DPTUNE_RAY_ADDRESS``, stays up and degraded, queues what is
posted and submits it when the head answers; a head killed under a running job leaves the job
running until the head is gone for good (``DPTUNE_RAY_GIVE_UP_S``), then failed, charged
exactly the attempts it recorded.

The head is this module's own (its own temp dir and ports, the session head's token), started
and killed by the tests — never ``ray stop``, which would end every head on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.cluster import RayConnection
from service.cluster.head import choose_record, probe

from .cluster import _ray_cli, process_tree, token_root
from .conftest import Service, long_job, small_job
from .conftest import serving as serve_on
from .test_jobs import charged, spent_on

HOST = "127.0.0.1"


@dataclass
class Head:
    """A Ray head on a dashboard port chosen before it exists, started and killed at will.

    Until it starts, the dashboard's port is held (bound, not listened on: a probe is refused),
    so that no port drawn meanwhile — the service's, the head's others — can be it."""

    root: Path
    token_path: Path
    temp_dir: Path | None = None
    dashboard_port: int = field(init=False)
    _held: socket.socket = field(init=False, default_factory=socket.socket)

    def __post_init__(self) -> None:
        self._held.bind(("", 0))
        self.dashboard_port = int(self._held.getsockname()[1])

    @property
    def connection(self) -> RayConnection:
        token = self.token_path.read_text().strip()
        return RayConnection(f"http://{HOST}:{self.dashboard_port}", token, started_here=False)

    @property
    def up(self) -> bool:
        return probe(self.connection) is None

    def start(self) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="h", dir=self.root))
        record = choose_record(self.dashboard_port).model_copy(update={"temp_dir": self.temp_dir})
        self._held.close()
        cmd = [
            _ray_cli(),
            "start",
            "--head",
            *record.flags(),
            f"--dashboard-host={HOST}",
            "--num-cpus=2",
            "--num-gpus=0",
            f"--object-store-memory={100 * 1024**2}",
            "--disable-usage-stats",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_", "RAY_"))}
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        wait_for(lambda: self.up, timeout=120)

    def kill(self) -> None:
        """Kill the head's processes at once — the machine it ran on died — and its jobs'."""
        self._held.close()
        if self.temp_dir is None:
            return
        while pids := process_tree(str(self.temp_dir)):
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


def wait_for(condition: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)
    return result


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """Not started: a test starts it."""
    root, token_path = token_root("dpt-late-")
    late = Head(root, token_path)
    try:
        yield late
    finally:
        late.kill()
        shutil.rmtree(root, ignore_errors=True)


def serving(head: Head, data_dir: Path, **settings: Any) -> AbstractContextManager[Service]:
    """The service with ``DPTUNE_RAY_ADDRESS`` at ``head``, polling every 0.5 s."""
    url = head.connection.dashboard_url
    return serve_on(head.connection, data_dir, 0.5, ray_address=url, **settings)


def health(service: Service) -> dict[str, Any]:
    r = service.client.get("/healthz")
    assert r.status_code == 200
    return dict(r.json())


def register(service: Service) -> int:
    body = {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5}
    return int(service.post("/v1/datasets", body)["id"])


def test_a_job_posted_while_ray_is_down_runs_when_it_comes_up(head: Head, tmp_path) -> None:
    assert not head.up
    with serving(head, tmp_path / "data") as service:
        down = wait_for(lambda: health(service)["ray"]["reachable"] is False, timeout=30)
        assert down and health(service)["status"] == "degraded"
        digits = register(service)
        job = service.post("/v1/jobs", small_job(digits))
        assert job["status"] == "queued"
        time.sleep(1)  # polls go on
        assert service.get(f"/v1/jobs/{job['id']}")["status"] == "queued"
        budget = service.get(f"/v1/datasets/{digits}/budget")
        assert budget["reserved"] > 0 and budget["spent"] == 0  # the reservation is held

        head.start()
        done = service.wait(job["id"], timeout=180)
        assert done["status"] == "released", service.orchestrator.logs(job["id"])[-3000:]
        assert health(service)["status"] == "ok"
        budget = service.get(f"/v1/datasets/{digits}/budget")
        assert len(charged(budget)) == 2  # its two trials, each charged once
        assert budget["spent"] == pytest.approx(spent_on(job["plan"], 2), rel=1e-9)
        assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)


def test_a_head_killed_under_a_running_job(head: Head, tmp_path) -> None:
    if not head.up:
        head.start()
    with serving(head, tmp_path / "data", ray_give_up_s=8.0) as service:
        digits = register(service)
        job = service.post("/v1/jobs", long_job(digits))
        trials = f"/v1/jobs/{job['id']}/trials"
        service.wait(job["id"], until=lambda _: service.get(trials) != [], timeout=120)

        head.kill()
        wait_for(lambda: health(service)["ray"]["reachable"] is False, timeout=10)
        assert service.get(f"/v1/jobs/{job['id']}")["status"] == "running"  # not lost
        assert service.get("/v1/datasets")[0]["id"] == digits  # reads work

        done = service.wait(job["id"], timeout=60)
        assert done["status"] == "failed" and "DPTUNE_RAY_GIVE_UP_S" in done["error"]
        attempts = [a for t in service.get(trials) for a in t["attempts"]]
        assert attempts and all(a["ended_at"] is not None for a in attempts)
        budget = service.get(f"/v1/datasets/{digits}/budget")
        assert len(charged(budget)) == len(attempts)  # what touched data, nothing more
        assert budget["spent"] == pytest.approx(spent_on(job["plan"], len(attempts)), rel=1e-9)
        assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
        assert health(service)["status"] == "degraded"  # and it stays up
