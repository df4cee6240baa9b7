"""The control plane survives its dependencies (issue 13): with Ray unreachable — at start or
later — the service starts and stays up, reads work, jobs are queued with their reservations
held and submitted once when Ray answers again, and an outage is never settled as a lost job.

Ray's absence is real where it can be (a :class:`RayOrchestrator` at a closed port; the
``dptune serve`` process); its coming back, and a reply lost on the way, are injected by
:class:`Cluster`, a test double. The real Ray head going away is in tests/e2e/test_degraded.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from service import lifecycle
from service.api import create_app
from service.api.server import free_port
from service.cli.serve import serve
from service.cluster import RayConnection, RayOrchestrator, head, ray_jobs
from service.cluster.head import LocalHead
from service.cluster.ray_jobs import SubmissionRefused
from service.db import Job
from service.orchestration import JobState, OrchestratorUnavailable, Submission
from service.settings import Settings

from .conftest import OPERATOR_KEY, Api, bearer, make_spec

POLL_S = 0.05


@dataclass
class Cluster:
    """An orchestrator whose cluster can go away: while ``up`` is False every call raises
    :class:`OrchestratorUnavailable`, as :class:`RayOrchestrator` does for a stopped head.
    ``jobs`` is what it runs, by job id; it files a job under its id, so a second submission
    of one job is taken as done (Ray: the submission id). With ``lose_reply`` the next
    submission gets through but its reply is lost on the way back."""

    up: bool = True
    jobs: dict[int, JobState] = field(default_factory=dict)
    submissions: list[Submission] = field(default_factory=list)
    checks: int = 0
    lose_reply: bool = False
    submit_s: float = 0.0
    dashboard_url: str | None = None

    def _answer(self) -> None:
        if not self.up:
            raise OrchestratorUnavailable("no answer from the test cluster")

    def check(self) -> None:
        self.checks += 1
        self._answer()

    def submit(self, submission: Submission) -> None:
        self._answer()
        time.sleep(self.submit_s)
        if submission.job_id not in self.jobs:
            self.submissions.append(submission)
            self.jobs[submission.job_id] = JobState.QUEUED
        if self.lose_reply:
            self.lose_reply = False
            raise OrchestratorUnavailable("the reply was lost")

    def status(self, job_id: int) -> JobState:
        self._answer()
        return self.jobs.get(job_id, JobState.LOST)

    def cancel(self, job_id: int) -> None:
        self._answer()
        if job_id in self.jobs:
            self.jobs[job_id] = JobState.CANCELLED

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {job_id: self.status(job_id) for job_id in job_ids} if self.up else {}

    def polls(self, rounds: int = 5) -> None:
        """Wait until the service has polled ``rounds`` more times."""
        until = self.checks + rounds
        eventually(lambda: self.checks >= until)


def eventually(condition: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return result


def closed_port() -> int:
    return free_port()  # nothing listens there once the probe socket is closed


@dataclass
class Service:
    api: Api
    analyst: dict[str, str]
    dataset: int
    stop: Callable[[], None]

    def post_job(self, **privacy: Any) -> dict[str, Any]:
        r = self.api.client.post("/v1/jobs", headers=self.analyst, json=self.spec(**privacy))
        assert r.status_code == 202, r.text
        return r.json()

    def spec(self, **privacy: Any) -> dict[str, Any]:
        return make_spec(self.dataset, epsilon=1.0, **privacy)

    def job(self, job_id: int) -> dict[str, Any]:
        r = self.api.client.get(f"/v1/jobs/{job_id}", headers=self.api.operator)
        assert r.status_code == 200, r.text
        return r.json()

    def row(self, job_id: int) -> Job:
        with self.api.client.app.state.sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job

    def entries(self, job_id: int) -> list[str]:
        """The kinds of a job's ledger rows, in order."""
        rows = self.api.budget(self.dataset)["entries"]
        return [e["kind"] for e in rows if e["job"] == job_id]

    def health(self) -> dict[str, Any]:
        r = self.api.client.get("/healthz")
        assert r.status_code == 200
        return r.json()

    def run_attempt(self, job_id: int, token: str) -> None:
        """What a job's runner does before a trial reads data: record (and so charge) it."""
        r = self.api.client.post(
            f"/internal/v1/jobs/{job_id}/attempts",
            headers=bearer(token),
            json={"index": 0, "params": {"optimizer.lr": 0.05}},
        )
        assert r.status_code == 201, r.text


def settings_for(settings: Settings, **changes: Any) -> Settings:
    return Settings(
        data_dir=settings.data_dir,
        database_url=settings.database_url,
        operator_key=OPERATOR_KEY,
        **changes,
    )


@pytest.fixture
def start(settings: Settings) -> Iterator[Callable[..., Service]]:
    """``start(orchestrator, **settings)``: the service polling ``orchestrator`` every
    50 ms, with a dataset and an analyst key."""
    running: list[TestClient] = []

    def make(
        orchestrator: Any, poll: float | None = POLL_S, again: Service | None = None, **changes: Any
    ) -> Service:
        """``again``: a restart of that service (same database, dataset and keys)."""
        app = create_app(settings_for(settings, **changes), orchestrator, poll)
        client = TestClient(app)
        client.__enter__()
        running.append(client)

        def stop() -> None:
            running.remove(client)
            client.__exit__(None, None, None)

        api = Api(client, bearer(OPERATOR_KEY))
        if again is not None:
            return Service(api, again.analyst, again.dataset, stop)
        dataset = api.register()["id"]
        return Service(api, api.analyst(dataset), dataset, stop)

    yield make
    for client in reversed(running):
        client.__exit__(None, None, None)


def test_the_service_starts_and_serves_with_ray_unreachable(start) -> None:
    port = closed_port()
    ray = RayOrchestrator(
        RayConnection(f"http://ray:s3cret-pw@127.0.0.1:{port}", "ray-token", False),
        "http://dptune:8000",
        Path("/nonexistent"),
        "test",
    )
    svc = start(ray)
    health = eventually(lambda: svc.health()["ray"]["reachable"] is False and svc.health())
    assert health["status"] == "degraded" and health["database"] == "ok"
    error = health["ray"]["error"]
    assert error == "no answer from the Ray Jobs API (ConnectError)"
    assert str(port) not in str(health) and "s3cret" not in str(health)  # unauthenticated

    c, ana = svc.api.client, svc.analyst
    assert c.post("/v1/plans", headers=ana, json=svc.spec()).status_code == 200
    job = svc.post_job()
    assert job["status"] == "queued"
    assert c.get(f"/v1/jobs/{job['id']}", headers=ana).json()["status"] == "queued"
    assert [j["id"] for j in c.get("/v1/jobs", headers=ana).json()] == [job["id"]]
    budget = svc.api.budget(svc.dataset)
    assert budget["reserved"] > 0 and budget["spent"] == 0  # the reservation is held
    assert svc.row(job["id"]).submitted_at is None
    time.sleep(0.5)  # polls go on: nothing is settled on an outage
    assert svc.job(job["id"])["status"] == "queued"
    assert svc.entries(job["id"]) == ["reservation"]
    assert svc.api.budget(svc.dataset) == budget


def test_queued_jobs_are_submitted_once_in_order_when_ray_answers_again(start) -> None:
    cluster = Cluster(up=False)
    svc = start(cluster)
    jobs = [svc.post_job()["id"] for _ in range(3)]
    cluster.polls()
    assert cluster.submissions == []
    assert svc.health()["status"] == "degraded"
    assert all(svc.job(j)["status"] == "queued" for j in jobs)

    cluster.up = True
    eventually(lambda: all(svc.row(j).submitted_at is not None for j in jobs))
    assert [s.job_id for s in cluster.submissions] == jobs  # once each, in id order
    cluster.polls()
    assert len(cluster.submissions) == 3
    assert svc.health() == {
        "status": "ok",
        "database": "ok",
        "ray": {"reachable": True, "error": None},
    }
    # each job's runner holds the token it was submitted with
    svc.run_attempt(jobs[0], cluster.submissions[0].token)
    assert svc.entries(jobs[0]) == ["reservation", "charge"]


class SlowFirstProbe(Cluster):
    """A cluster whose first probe waits for ``answer`` (a local head starting: minutes)."""

    def __init__(self, up: bool) -> None:
        super().__init__(up=up)
        self.answer = threading.Event()

    def check(self) -> None:
        self.answer.wait(timeout=30)
        super().check()


@pytest.mark.parametrize(("up", "then"), [(True, "ok"), (False, "degraded")])
def test_healthz_tells_not_polled_yet_from_degraded(start, up, then) -> None:
    cluster = SlowFirstProbe(up)
    svc = start(cluster)
    starting = svc.health()
    assert starting == {
        "status": "starting",
        "database": "ok",
        "ray": {"reachable": None, "error": None},
    }
    cluster.answer.set()
    health = eventually(lambda: (h := svc.health())["ray"]["reachable"] is not None and h)
    assert health["status"] == then and health["ray"]["reachable"] is up


def test_a_submission_whose_reply_was_lost_is_not_submitted_again(start) -> None:
    cluster = Cluster(lose_reply=True)
    svc = start(cluster, poll=None)
    job = svc.post_job()["id"]
    assert len(cluster.submissions) == 1 and svc.row(job).submitted_at is None

    with svc.api.client.app.state.sessions() as session:  # the poller's round
        lifecycle.submit_pending(session, cluster)
    assert len(cluster.submissions) == 1
    assert svc.row(job).submitted_at is not None
    svc.run_attempt(job, cluster.submissions[0].token)  # its runner's token still works


def test_a_restart_submits_what_was_queued(start, settings) -> None:
    down = Cluster(up=False)
    first = start(down)
    job = first.post_job()["id"]
    first.stop()  # the service stops with the job queued

    cluster = Cluster()
    second = start(cluster, again=first)
    eventually(lambda: second.row(job).submitted_at is not None)
    assert [s.job_id for s in cluster.submissions] == [job]
    assert second.job(job)["status"] == "queued"
    assert second.entries(job) == ["reservation"]


def test_two_pollers_submit_a_job_once(start) -> None:
    cluster = Cluster(up=False, submit_s=0.1)
    svc = start(cluster, poll=None)
    jobs = [svc.post_job()["id"] for _ in range(2)]
    cluster.up = True

    def poll() -> None:
        with svc.api.client.app.state.sessions() as session:
            lifecycle.submit_pending(session, cluster)

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    for t in pollers:
        t.join()
    assert sorted(s.job_id for s in cluster.submissions) == jobs
    for submission in cluster.submissions:  # each runner holds the token its job expects
        svc.run_attempt(submission.job_id, submission.token)


def _running(svc, cluster: Cluster) -> int:
    """A job posted, handed over, running on the cluster with one attempt charged; its id."""
    job = svc.post_job()["id"]
    eventually(lambda: cluster.submissions)
    cluster.jobs[job] = JobState.RUNNING
    svc.run_attempt(job, cluster.submissions[0].token)
    return job


def test_a_running_job_is_left_alone_while_ray_is_unreachable(start) -> None:
    cluster = Cluster()
    svc = start(cluster)
    job = _running(svc, cluster)
    budget = svc.api.budget(svc.dataset)

    cluster.up = False
    cluster.polls(10)
    assert svc.job(job)["status"] == "running"  # a GET asks too: unknown is not lost
    assert svc.entries(job) == ["reservation", "charge"]
    assert svc.api.budget(svc.dataset) == budget
    r = svc.api.client.post(f"/v1/jobs/{job}/cancel", headers=svc.analyst)
    assert r.status_code == 503 and r.json()["errors"][0]["field"] == "job"

    cluster.up = True  # it comes back, and the job ends as it would have
    cluster.jobs[job] = JobState.SUCCEEDED
    eventually(lambda: svc.job(job)["status"] == "succeeded")
    assert svc.entries(job) == ["reservation", "charge", "release"]


def test_ray_gone_for_good_fails_its_jobs_charged_what_they_ran(start) -> None:
    cluster = Cluster()
    svc = start(cluster, ray_give_up_s=1.0)
    running = _running(svc, cluster)
    spent = svc.api.budget(svc.dataset)["spent"]

    cluster.up = False
    waiting = svc.post_job()["id"]  # never handed over
    eventually(lambda: svc.job(running)["status"] == "failed")
    job = svc.job(running)
    assert "DPTUNE_RAY_GIVE_UP_S" in job["error"]
    budget = svc.api.budget(svc.dataset)
    assert budget["spent"] == pytest.approx(spent, rel=1e-12)  # the one attempt it recorded
    assert svc.entries(running) == ["reservation", "charge", "release"]
    assert svc.entries(waiting) == ["reservation"]
    cluster.polls()
    assert svc.job(waiting)["status"] == "queued"  # nothing of it ran: it waits for Ray
    # a failed job's runner, should it still run somewhere, can start nothing more
    r = svc.api.client.post(
        f"/internal/v1/jobs/{running}/attempts",
        headers=bearer(cluster.submissions[0].token),
        json={"index": 1, "params": {"optimizer.lr": 0.2}},
    )
    assert r.status_code == 409


def test_only_an_answer_that_it_has_no_record_makes_a_job_lost(start) -> None:
    cluster = Cluster()
    svc = start(cluster)
    job = _running(svc, cluster)
    cluster.up = False
    cluster.jobs.clear()  # the cluster was replaced meanwhile
    cluster.polls()
    assert svc.job(job)["status"] == "running"

    cluster.up = True
    eventually(lambda: svc.job(job)["status"] == "failed")
    assert svc.entries(job) == ["reservation", "charge", "charge"]  # the whole reservation
    assert svc.api.budget(svc.dataset)["reserved"] == pytest.approx(0, abs=1e-12)


def test_a_queued_job_is_cancelled_while_ray_is_unreachable(start) -> None:
    cluster = Cluster(up=False)
    svc = start(cluster)
    job = svc.post_job()["id"]
    r = svc.api.client.post(f"/v1/jobs/{job}/cancel", headers=svc.analyst)
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    assert svc.entries(job) == ["reservation", "release"]
    assert svc.api.budget(svc.dataset)["spent"] == 0
    cluster.up = True
    cluster.polls()
    assert cluster.submissions == []


def test_the_poller_survives_any_orchestrator_failure(start, caplog) -> None:
    class Broken(Cluster):
        def check(self) -> None:
            self.checks += 1
            raise ValueError("unexpected\nacross lines")

    cluster = Broken()
    with caplog.at_level(logging.WARNING, logger="service.api.app"):
        svc = start(cluster)
        cluster.polls(10)
    assert svc.api.client.get("/v1/datasets", headers=svc.api.operator).status_code == 200
    (record,) = [r for r in caplog.records if "polling failed" in r.getMessage()]
    assert record.exc_info is None and "\n" not in record.getMessage()
    assert "ValueError: unexpected across lines" in record.getMessage()


class StubClient:
    """Stands in for Ray's JobSubmissionClient, failing as the SDK does (read in
    ray/dashboard/modules/dashboard_sdk.py and job/sdk.py; checked against a real head)."""

    error: Exception

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_job_status(self, submission_id: str) -> Any:
        raise self.error

    def submit_job(self, **kwargs: Any) -> str:
        raise self.error


NOT_FOUND = RuntimeError("Request failed with status code 404: Job dptune-t-job-1 does not exist.")


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (NOT_FOUND, JobState.LOST),
        (RuntimeError("Request failed with status code 404: <html>Not Found</html>."), None),
        (RuntimeError("Request failed with status code 500: Traceback …"), None),
        (RuntimeError("Request failed with status code 502: Bad Gateway."), None),
        (requests.exceptions.ConnectionError("HTTPConnectionPool(… refused)"), None),
        (requests.exceptions.ReadTimeout("read timed out"), None),
    ],
)
def test_only_rays_own_404_is_lost(monkeypatch, error, state) -> None:
    monkeypatch.setattr(ray_jobs, "JobSubmissionClient", StubClient)
    monkeypatch.setattr(StubClient, "error", error, raising=False)
    ray = RayOrchestrator(RayConnection("http://ray:8265", None, False), "", Path("."), "t")
    if state is None:
        with pytest.raises(OrchestratorUnavailable):
            ray.status(1)
    else:
        assert ray.status(1) == state


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (
            RuntimeError(
                "Request failed with status code 500: Traceback …\nValueError: Job with "
                "submission_id dptune-t-job-1 already exists. Please use a different "
                "submission_id."
            ),
            None,  # Ray has it: submitted
        ),
        (
            RuntimeError(
                "Request failed with status code 500: No available agent to submit job, "
                "please try again later."
            ),
            OrchestratorUnavailable,
        ),
        (requests.exceptions.ConnectionError("refused"), OrchestratorUnavailable),
        (RuntimeError("Request failed with status code 400: bad request."), SubmissionRefused),
    ],
)
def test_what_a_submission_failure_means(monkeypatch, error, outcome) -> None:
    monkeypatch.setattr(ray_jobs, "JobSubmissionClient", StubClient)
    monkeypatch.setattr(StubClient, "error", error, raising=False)
    ray = RayOrchestrator(RayConnection("http://ray:8265", None, False), "", Path("."), "t")
    submission = Submission(1, "dpr_token", "digits")
    if outcome is None:
        ray.submit(submission)
    else:
        with pytest.raises(outcome):
            ray.submit(submission)


def test_a_local_head_that_does_not_start_is_retried_in_the_background(
    monkeypatch, tmp_path
) -> None:
    tries: list[int] = []

    def cannot_start(record: head.HeadRecord, *_: object) -> None:
        tries.append(record.dashboard_port)
        raise head.HeadError("`ray start` failed: port taken")

    monkeypatch.setattr(head, "_start_head", cannot_start)
    port = closed_port()
    ray = RayOrchestrator(
        RayConnection(f"http://127.0.0.1:{port}", None, False),
        "",
        Path("."),
        "t",
        LocalHead(tmp_path, port, retry_s=0.5),
    )
    for _ in range(3):  # the poller's rounds: one try per retry_s
        with pytest.raises(OrchestratorUnavailable, match="could not start the local Ray head"):
            ray.check()
    assert tries == [port]
    time.sleep(0.5)
    with pytest.raises(OrchestratorUnavailable):
        ray.check()
    assert tries == [port, port]


# --- dptune serve ---------------------------------------------------------------------------


NO_RAY_TOKEN = {"RAY_AUTH_MODE": "disabled"}  # no token file, no change to os.environ


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    return app


def _one_line(result: Any) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line, result.stderr
    return line


def test_serve_names_a_bad_setting_in_one_line(tmp_path) -> None:
    env = {
        **NO_RAY_TOKEN,
        "DPTUNE_DATA_DIR": str(tmp_path),
        "DPTUNE_POLL_INTERVAL_S": "0",
        "DPTUNE_OPERATOR_KEY": "short-s3cret",
    }
    line = _one_line(CliRunner().invoke(_cli(), [], env=env))
    assert line.startswith("dptune: invalid setting ")
    assert "DPTUNE_POLL_INTERVAL_S: Input should be greater than 0" in line
    assert "DPTUNE_OPERATOR_KEY: " in line
    assert "short-s3cret" not in line  # never the value: it may be a secret


def test_serve_names_an_unreachable_database_in_one_line(tmp_path) -> None:
    env = {
        **NO_RAY_TOKEN,
        "DPTUNE_DATA_DIR": str(tmp_path),
        "DPTUNE_DATABASE_URL": f"postgresql+psycopg://dptune:pw-s3cret@127.0.0.1:{closed_port()}/x",
        "DPTUNE_RAY_ADDRESS": f"http://127.0.0.1:{closed_port()}",
    }
    line = _one_line(CliRunner().invoke(_cli(), [], env=env))
    assert line.startswith("dptune: cannot connect to the database DPTUNE_DATABASE_URL=")
    assert "pw-s3cret" not in line


def test_serve_refuses_a_ray_address_that_is_not_a_url(tmp_path) -> None:
    env = {**NO_RAY_TOKEN, "DPTUNE_DATA_DIR": str(tmp_path), "DPTUNE_RAY_ADDRESS": "ray:6379"}
    line = _one_line(CliRunner().invoke(_cli(), [], env=env))
    assert "DPTUNE_RAY_ADDRESS must be the URL of the Ray dashboard" in line


def test_serve_starts_degraded_with_ray_unreachable(tmp_path, database_url) -> None:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_")},
        "DPTUNE_DATA_DIR": str(tmp_path),
        "DPTUNE_OPERATOR_KEY": OPERATOR_KEY,
        "DPTUNE_RAY_ADDRESS": f"http://127.0.0.1:{closed_port()}",
        "DPTUNE_POLL_INTERVAL_S": "0.2",
        **({"DPTUNE_DATABASE_URL": database_url} if database_url else {}),
    }
    dptune = str(Path(sys.executable).parent / "dptune")
    cmd = [dptune, "serve", "--port", str(port)]
    process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:

            def degraded() -> dict[str, Any] | None:
                assert process.poll() is None, process.stderr.read()  # type: ignore[union-attr]
                try:
                    health = c.get("/healthz").json()
                except httpx.TransportError:
                    return None
                return health if health["ray"]["reachable"] is False else None

            health = eventually(degraded, timeout=120)
            assert health["status"] == "degraded" and health["database"] == "ok"
            operator = bearer(OPERATOR_KEY)
            assert c.get("/v1/datasets", headers=operator).status_code == 200
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "Ray does not answer (no answer from the Ray Jobs API (ConnectError))" in stderr
    assert "Traceback" not in stderr
