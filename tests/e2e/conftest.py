"""End to end on a real Ray: one local head for the whole session (2 CPUs, token auth on, its
own dashboard port), the API on a real SQLite file, jobs submitted as Ray jobs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.cluster import RayConnection, RayOrchestrator, connect
from service.cluster.ray_jobs import namespace
from service.settings import Settings

OPERATOR = {"Authorization": "Bearer dpt_e2e-operator-key-0123456789"}
TEST_DASHBOARD_PORT = 8275


#: what an operator's environment holds when dptune starts the Ray head: none of it may reach
#: a Ray worker
OPERATOR_ENV = {
    "DPTUNE_OPERATOR_KEY": OPERATOR["Authorization"][7:],
    "DPTUNE_DATABASE_URL": "postgresql+psycopg://dptune:e2e-db-passw0rd@db/dptune",
}


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayConnection]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in OPERATOR_ENV.items():
            env.setenv(name, value)
        # the operator's own models (test_own_model.py), installed on every Ray node
        env.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "models_pkg"), prepend=":")
        connection = connect(
            tmp_path_factory.mktemp("ray"),
            dashboard_port=TEST_DASHBOARD_PORT,
            num_cpus=2,
            num_gpus=0,
        )
    yield connection
    connection.stop()


@dataclass
class Service:
    client: httpx.Client
    orchestrator: RayOrchestrator
    settings: Settings

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] = OPERATOR) -> Any:
        r = self.client.post(path, headers=headers, json=body)
        assert r.status_code in (200, 201, 202), r.text
        return r.json()

    def get(self, path: str, headers: dict[str, str] = OPERATOR) -> Any:
        r = self.client.get(path, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    def wait(
        self, job_id: int, until: Callable[[dict], bool] | None = None, timeout: float = 240
    ) -> dict:
        """Poll the job until ``until(job)`` (default: it has ended)."""
        until = until or (lambda j: j["status"] not in ("queued", "running"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get(f"/v1/jobs/{job_id}")
            if until(job):
                return job
            time.sleep(1)
        raise AssertionError(
            f"job {job_id} still {job['status']}:\n{self.orchestrator.logs(job_id)[-4000:]}"
        )

    def finished_logs(self, job_id: int, timeout: float = 60) -> str:
        """The job's whole driver log. The runner prints its closing table after it ended the
        job in the control plane, so the job's status there can be final before the log is:
        this waits for the Ray job (its driver) to be over first."""
        client, submission = self.orchestrator.client, self.orchestrator.submission_id(job_id)
        deadline = time.monotonic() + timeout
        while not client.get_job_status(submission).is_terminal():
            assert time.monotonic() < deadline, client.get_job_logs(submission)[-3000:]
            time.sleep(0.5)
        return client.get_job_logs(submission)


def environment(pid: int) -> dict[str, str]:
    """The environment of a running process."""
    raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def trial_processes() -> list[int]:
    """PIDs of the Ray workers that hold a Tune trial, training or not: a test kills one to
    inject a crash. Ray titles such a worker ``ray::ImplicitFunc.train`` while Tune waits in
    ``train()`` for its next result and ``ray::ImplicitFunc`` in between (a worker kept for a
    next trial under actor reuse is titled so too), so the title alone does not say whether
    the worker is training, importing torch, or done."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(
                b"ray::ImplicitFunc"
            ):
                pids.append(int(proc.name))
        except OSError:  # the process ended meanwhile
            continue
    return pids


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def start_service(ray_head: RayConnection, data_dir: Path):
    """The service on a real port (jobs' runners call its internal API over HTTP)."""
    return lambda: serving(ray_head, data_dir)


@contextmanager
def serving(
    connection: RayConnection, data_dir: Path, poll_interval: float = 1.0, **overrides: Any
) -> Iterator[Service]:
    """The service on a real port, its jobs on the cluster behind ``connection``; ``overrides``
    are further settings."""
    settings = Settings(data_dir=data_dir, operator_key=OPERATOR["Authorization"][7:], **overrides)
    settings.data_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    orchestrator = RayOrchestrator(
        connection,
        f"http://127.0.0.1:{port}",
        settings.data_path,
        namespace(settings.sqlalchemy_url),
    )
    app = create_app(settings, orchestrator, poll_interval=poll_interval)
    with (
        BackgroundServer(app, port) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield Service(client, orchestrator, settings)


@pytest.fixture
def service(start_service) -> Iterator[Service]:
    with start_service() as s:
        yield s


def small_job(dataset: int, accounting: str = "rdp", **privacy: Any) -> dict[str, Any]:
    """Logistic regression on digits, one epoch per trial, public validation."""
    return {
        "dataset": dataset,
        "model": {"name": "logreg"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.5},
        "validation": {"split": "public"},
        "epochs": 1,
        "batch_size": 64,
        "search_space": (
            {"method.threshold": {"grid": [0.5, 2.0]}}
            if accounting == "rdp"
            else {"method.threshold": {"values": [0.5, 1.0, 2.0]}}
        ),
        "privacy": {"epsilon": 2.0, "accounting": accounting, **privacy},
    }


def long_job(dataset: int) -> dict[str, Any]:
    """:func:`small_job` long enough to be running still seconds after its first trial starts
    (its trials run 6,740 steps; 30 epochs took 0.7 s, and such a job sometimes ended before a
    test could stop the service or kill the head under it)."""
    return small_job(dataset) | {"epochs": 300}


@pytest.fixture
def digits(service: Service) -> int:
    return service.post(
        "/v1/datasets",
        {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
    )["id"]
