"""Jobs that cannot run say so (issue 42): a job whose trials no node of the cluster can run is
refused at admission with a 422 naming the field and nothing reserved; one admitted while the
cluster did not answer is refused when it is handed over, having run nothing; the job view
says why a job waits or failed — in full to operators, to analysts only reasons settled
before the job started; operators read a job's driver log, analysts cannot.

The cluster is :class:`FakeCluster`, a test double; the Ray side of the hand-over check runs
the real :class:`RayOrchestrator` against a stub of Ray's client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from service import admission
from service.api import create_app
from service.api.jobs import CANCELLED, NEVER_STARTED, UNSUBMITTED
from service.cluster import RayConnection, RayOrchestrator, ray_jobs
from service.orchestration import (
    JobState,
    Node,
    OrchestratorUnavailable,
    Submission,
)
from service.settings import Settings

from .conftest import OPERATOR_KEY, Api, bearer, make_spec

SAFE_REASONS = {None, UNSUBMITTED, NEVER_STARTED, CANCELLED}


@dataclass
class FakeCluster:
    """An orchestrator with ``nodes``; while ``up`` is False every call raises
    :class:`OrchestratorUnavailable`. ``said`` is its message for every job, ``log`` every
    job's driver log."""

    nodes_: list[Node] = field(default_factory=lambda: [Node(cpu=2, gpu=0)])
    up: bool = True
    said: str | None = None
    log: str = ""
    jobs: dict[int, JobState] = field(default_factory=dict)
    dashboard_url: str | None = None

    def _answer(self) -> None:
        if not self.up:
            raise OrchestratorUnavailable("no answer from the test cluster")

    def check(self) -> None:
        self._answer()

    def submit(self, submission: Submission) -> None:
        self._answer()
        self.jobs.setdefault(submission.job_id, JobState.QUEUED)

    def status(self, job_id: int) -> JobState:
        self._answer()
        return self.jobs.get(job_id, JobState.LOST)

    def cancel(self, job_id: int) -> None:
        self._answer()
        self.jobs[job_id] = JobState.CANCELLED

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {j: self.status(j) for j in job_ids} if self.up else {}

    def nodes(self) -> list[Node]:
        self._answer()
        return self.nodes_

    def message(self, job_id: int) -> str | None:
        self._answer()
        return self.said

    def logs(self, job_id: int) -> str:
        self._answer()
        return self.log


@dataclass
class Service:
    api: Api
    analyst: dict[str, str]
    dataset: int

    @property
    def client(self) -> TestClient:
        return self.api.client

    def post_job(self, headers: dict[str, str] | None = None, **resources: float) -> Any:
        spec = make_spec(self.dataset) | {"resources": resources}
        return self.client.post("/v1/jobs", headers=headers or self.analyst, json=spec)

    def job(self, job_id: int, headers: dict[str, str]) -> dict[str, Any]:
        r = self.client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def state(self) -> tuple[dict[str, Any], list[Any]]:
        """The dataset's budget (its ledger rows included) and the job list."""
        jobs = self.client.get("/v1/jobs", headers=self.api.operator).json()
        return self.api.budget(self.dataset), jobs


@pytest.fixture
def start(settings: Settings) -> Iterator[Callable[..., Service]]:
    """``start(orchestrator, poll=None, **settings)``: the service, a dataset, an analyst."""
    running: list[TestClient] = []

    def make(orchestrator: Any, poll: float | None = None, **changes: Any) -> Service:
        config = Settings(
            data_dir=settings.data_dir,
            database_url=settings.database_url,
            operator_key=OPERATOR_KEY,
            **changes,
        )
        client = TestClient(create_app(config, orchestrator, poll))
        client.__enter__()
        running.append(client)
        api = Api(client, bearer(OPERATOR_KEY))
        dataset = api.register()["id"]
        return Service(api, api.analyst(dataset), dataset)

    yield make
    for client in reversed(running):
        client.__exit__(None, None, None)


def eventually(condition: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return result


amounts = st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0, 8.0])
nodes = st.lists(st.builds(Node, cpu=amounts, gpu=amounts), max_size=4)
requests = st.fixed_dictionaries(
    {"cpu": st.sampled_from([0.5, 1.0, 2.0, 3.0, 8.0, 64.0]), "gpu": amounts}
)


@given(nodes=nodes, wanted=requests)
def test_a_job_is_refused_exactly_when_no_node_has_what_one_trial_asks(
    nodes: list[Node], wanted: dict[str, float]
) -> None:
    problem = admission.misfit(wanted, nodes)
    fits = [n for n in nodes if n.cpu >= wanted["cpu"] and n.gpu >= wanted["gpu"]]
    assert (problem is None) == (bool(fits) or not nodes)
    if problem is None:
        return
    over_cpu = all(n.cpu < wanted["cpu"] for n in nodes)
    over_gpu = all(n.gpu < wanted["gpu"] for n in nodes)
    expected = "resources.cpu" if over_cpu else "resources.gpu" if over_gpu else "resources"
    assert problem.field == expected


CLUSTER = [Node(cpu=2, gpu=0), Node(cpu=1, gpu=1)]


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"cpu": 4}, "resources.cpu"),
        ({"cpu": 64}, "resources.cpu"),
        ({"cpu": 1, "gpu": 2}, "resources.gpu"),
        ({"cpu": 2, "gpu": 1}, "resources"),  # each fits some node, not both the same one
        ({"cpu": 2.5, "gpu": 0.5}, "resources.cpu"),
    ],
)
def test_an_unschedulable_job_is_refused_with_nothing_reserved(start, resources, field) -> None:
    svc = start(FakeCluster(CLUSTER))
    before = svc.state()
    r = svc.post_job(**resources)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == field
    assert "could never start" in r.json()["detail"]
    assert svc.state() == before  # no job, no ledger row, the same budget
    plan = svc.client.post("/v1/plans", headers=svc.analyst, json=make_spec(svc.dataset))
    assert plan.status_code == 200


@pytest.mark.parametrize("resources", [{"cpu": 2}, {"cpu": 1, "gpu": 1}, {"cpu": 0.5}])
def test_a_job_that_fits_a_node_is_admitted(start, resources) -> None:
    svc = start(FakeCluster(CLUSTER))
    r = svc.post_job(**resources)
    assert r.status_code == 202, r.text
    assert svc.api.budget(svc.dataset)["reserved"] > 0


def test_the_check_can_be_turned_off(start) -> None:
    svc = start(FakeCluster(CLUSTER), ray_check_resources=False)
    assert svc.post_job(cpu=64).status_code == 202


class StubClient:
    """Ray's JobSubmissionClient for a cluster that has no record of any job; it records
    what is submitted."""

    submitted: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_job_status(self, submission_id: str) -> Any:
        raise RuntimeError(
            f"Request failed with status code 404: Job {submission_id} does not exist."
        )

    def submit_job(self, **kwargs: Any) -> str:
        self.submitted.append(kwargs["submission_id"])
        return str(kwargs["submission_id"])


def stub_ray(monkeypatch, cluster: FakeCluster) -> RayOrchestrator:
    """The real RayOrchestrator on a stub client, whose probe and node list are ``cluster``'s."""
    monkeypatch.setattr(ray_jobs, "JobSubmissionClient", StubClient)
    monkeypatch.setattr(StubClient, "submitted", [])
    ray = RayOrchestrator(RayConnection("http://ray:8265", None, False), "", Path("."), "t")
    monkeypatch.setattr(ray, "check", cluster.check)
    monkeypatch.setattr(ray, "nodes", cluster.nodes)
    return ray


def test_a_job_admitted_unchecked_while_degraded_is_refused_at_hand_over(
    start, monkeypatch
) -> None:
    cluster = FakeCluster(up=False)
    svc = start(stub_ray(monkeypatch, cluster), poll=0.05)
    r = svc.post_job(cpu=4)
    assert r.status_code == 202, r.text  # admission does not block on a cluster that is down
    job = r.json()
    assert job["status"] == "queued" and job["reason"] == UNSUBMITTED
    assert svc.api.budget(svc.dataset)["reserved"] > 0

    cluster.up = True
    done = eventually(lambda: (j := svc.job(job["id"], svc.analyst))["status"] == "failed" and j)
    assert done["reason"] == NEVER_STARTED
    assert StubClient.submitted == []  # never reached Ray
    budget = svc.api.budget(svc.dataset)
    assert budget["reserved"] == 0 and budget["spent"] == 0
    operator = svc.job(job["id"], svc.api.operator)
    assert operator["reason"].startswith("submission failed: resources.cpu: ")
    assert "asks 4 CPUs; the most any node has is 2" in operator["reason"]


def listed(*nodes: dict[str, Any]) -> dict[str, Any]:
    """The body of Ray's ``GET /api/v0/nodes`` (read off a real head)."""
    return {"result": True, "msg": "", "data": {"result": {"total": len(nodes), "result": nodes}}}


@pytest.mark.parametrize(
    ("status", "body", "nodes"),
    [
        (
            200,
            listed(
                {"state": "ALIVE", "resources_total": {"CPU": 2.0, "memory": 1e9}},
                {"state": "DEAD", "resources_total": {"CPU": 64.0, "GPU": 8.0}},
                {"state": "ALIVE", "resources_total": {"CPU": 1.0, "GPU": 1.0}},
            ),
            [Node(cpu=2, gpu=0), Node(cpu=1, gpu=1)],
        ),
        (200, listed(), []),
        (200, {"data": {}}, OrchestratorUnavailable),
        (200, ["not", "a", "listing"], OrchestratorUnavailable),
        (401, {}, OrchestratorUnavailable),
        (503, {}, OrchestratorUnavailable),
    ],
)
def test_what_rays_node_listing_means(monkeypatch, status, body, nodes) -> None:
    def get(url: str, **_: Any) -> httpx.Response:
        assert url == "http://ray:8265/api/v0/nodes"
        return httpx.Response(status, json=body)

    monkeypatch.setattr(ray_jobs.httpx, "get", get)
    ray = RayOrchestrator(RayConnection("http://ray:8265", None, False), "", Path("."), "t")
    if nodes is OrchestratorUnavailable:
        with pytest.raises(OrchestratorUnavailable):
            ray.nodes()
    else:
        assert ray.nodes() == nodes


@pytest.mark.parametrize("resources", [{"cpu": 2}, {}])
def test_a_job_that_fits_is_handed_over_by_the_real_orchestrator(monkeypatch, resources) -> None:
    ray = stub_ray(monkeypatch, FakeCluster())
    ray.submit(Submission(7, "dpr_token", "digits", resources=resources))
    assert StubClient.submitted == ["dptune-t-job-7"]


def test_reasons_analysts_see_are_settled_before_the_job_starts(start) -> None:
    cluster = FakeCluster(said="Job has not started yet: waiting for resources")
    svc = start(cluster)
    op = svc.api.operator

    waiting = svc.post_job().json()["id"]  # submitted; Ray says why it waits
    assert svc.job(waiting, op)["reason"] == cluster.said
    assert svc.job(waiting, svc.analyst)["reason"] is None

    cluster.jobs[waiting] = JobState.RUNNING  # started, no trial yet
    running = svc.job(waiting, op)
    assert running["status"] == "running"
    assert running["reason"].startswith("no trial has started yet: each waits for 1 CPUs")
    assert svc.job(waiting, svc.analyst)["reason"] is None

    cluster.jobs[waiting] = JobState.FAILED  # after it started: nothing for analysts
    assert svc.job(waiting, op)["reason"] == cluster.said
    assert svc.job(waiting, svc.analyst)["status"] == "failed"
    assert svc.job(waiting, svc.analyst)["reason"] is None

    refused = svc.post_job().json()["id"]
    cluster.jobs[refused] = JobState.FAILED  # failed before it ever ran
    assert svc.job(refused, svc.analyst)["reason"] == NEVER_STARTED

    cancelled = svc.post_job().json()["id"]
    svc.client.post(f"/v1/jobs/{cancelled}/cancel", headers=svc.analyst)
    assert svc.job(cancelled, svc.analyst)["reason"] == CANCELLED

    cluster.up = False
    unsubmitted = svc.post_job().json()["id"]
    assert svc.job(unsubmitted, svc.analyst)["reason"] == UNSUBMITTED
    assert svc.job(unsubmitted, op)["reason"] == UNSUBMITTED
    listed = svc.client.get("/v1/jobs", headers=svc.analyst).json()
    assert {j["reason"] for j in listed} <= SAFE_REASONS
    assert all(j["error"] is None for j in listed)


def test_operators_read_a_jobs_log_in_pages_and_analysts_cannot(start) -> None:
    cluster = FakeCluster(log="".join(f"line {i}\n" for i in range(25)))
    svc = start(cluster)
    job = svc.post_job().json()["id"]
    logs = f"/v1/jobs/{job}/logs"
    op = svc.api.operator

    r = svc.client.get(logs, headers=svc.analyst)
    assert r.status_code == 403  # a log may quote private data
    assert svc.client.get("/v1/jobs/999/logs", headers=svc.analyst).status_code == 403
    assert svc.client.get("/v1/jobs/999/logs", headers=op).status_code == 404

    page = svc.client.get(logs, headers=op, params={"offset": 10, "limit": 5}).json()
    assert page == {
        "lines": [f"line {i}" for i in range(10, 15)],
        "offset": 10,
        "total": 25,
        "next_offset": 15,
    }
    rest = svc.client.get(logs, headers=op, params={"offset": 20}).json()
    assert rest["lines"] == [f"line {i}" for i in range(20, 25)] and rest["next_offset"] == 25
    assert svc.client.get(logs, headers=op, params={"limit": 0}).status_code == 422

    cluster.up = False
    r = svc.client.get(logs, headers=op)
    assert r.status_code == 503
    assert r.json()["detail"].startswith("cannot read the job's log now: no answer")
    unsubmitted = svc.post_job().json()["id"]
    empty = svc.client.get(f"/v1/jobs/{unsubmitted}/logs", headers=op).json()
    assert empty == {"lines": [], "offset": 0, "total": 0, "next_offset": 0}
