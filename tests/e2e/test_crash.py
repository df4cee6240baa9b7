"""Crash safety: ``dptune serve`` killed with SIGKILL while a job's trials run, then started
again on the same data dir and port. The job's runner waits for it (its calls retried with
backoff) and the job completes, its ledger consistent with what ran.

The other crash, kill -9 of a trial process, is in ``test_jobs.py``
(``test_a_retried_attempt_is_charged_too``); a dead node in ``test_multinode.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from service.api.server import free_port
from service.cluster import RayConnection, RayOrchestrator
from service.cluster.ray_jobs import namespace
from service.settings import Settings

from .conftest import OPERATOR, Service, small_job
from .test_jobs import spent_on


@contextmanager
def dptune_serve(
    ray_head: RayConnection, data_dir: Path, logs: Path
) -> Iterator[tuple[str, Callable[[], subprocess.Popen[bytes]]]]:
    """The service's URL, and ``start()``, which runs ``dptune serve`` there on ``data_dir``
    (a second start is a restart) against the session's Ray head and waits until it answers.
    Every process started is killed on the way out."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = logs / "ray_token"
    token.write_text(ray_head.token or "")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_", "RAY_"))}
    env |= {
        "DPTUNE_DATA_DIR": str(data_dir),
        "DPTUNE_OPERATOR_KEY": OPERATOR["Authorization"][7:],
        "DPTUNE_RAY_ADDRESS": ray_head.dashboard_url,
        "DPTUNE_CONTROL_URL": url,
        "DPTUNE_POLL_INTERVAL_S": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    dptune = shutil.which("dptune", path=str(Path(sys.executable).parent)) or "dptune"
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        log = (logs / f"serve-{len(started)}.log").open("wb")
        process = subprocess.Popen(
            [dptune, "serve", "--port", str(port)], env=env, stdout=log, stderr=log
        )
        started.append(process)
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dptune serve did not start: {log.name}")
            time.sleep(0.5)

    try:
        yield url, start
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def test_a_killed_service_restarts_and_its_job_completes(ray_head, tmp_path) -> None:
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    orchestrator = RayOrchestrator(  # the test's own view of the Ray jobs: logs, cleanup
        ray_head, "", settings.data_path, namespace(settings.sqlalchemy_url)
    )
    with (
        dptune_serve(ray_head, data_dir, tmp_path) as (url, start),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        first = start()
        service = Service(client, orchestrator, settings)
        dataset = service.post(
            "/v1/datasets",
            {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
        )["id"]
        spec = small_job(dataset)
        # long enough to be seen training: both trials of 10 epochs once ran between two polls
        # of ``wait`` (1 s apart), and the job ended before the service was killed
        spec["epochs"] = 80
        job = service.post("/v1/jobs", spec)
        try:

            def training(_: dict) -> bool:
                trials = service.get(f"/v1/jobs/{job['id']}/trials")
                return any(t["metrics"] and t["status"] == "running" for t in trials)

            service.wait(job["id"], until=training, timeout=120)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            time.sleep(5)  # down for a while: the trials' calls fail, and are retried
            start()
            done = service.wait(job["id"], timeout=150)
        finally:
            orchestrator.cancel(job["id"])  # never leave a job running on the shared head

        assert done["status"] == "released", orchestrator.logs(job["id"])[-3000:]
        trials = service.get(f"/v1/jobs/{job['id']}/trials")
        ran = [a for t in trials for a in t["attempts"]]
        assert all(a["status"] != "running" and a["ended_at"] for a in ran)
        assert all(t["status"] == "succeeded" for t in trials)
        assert all(j["status"] not in ("queued", "running") for j in service.get("/v1/jobs"))
        budget = service.get(f"/v1/datasets/{dataset}/budget")
        charges = [e for e in budget["entries"] if e["kind"] == "charge"]
        assert len(charges) == len(ran) >= 2
        assert budget["spent"] == pytest.approx(spent_on(job["plan"], len(ran)), rel=1e-9)
        assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
