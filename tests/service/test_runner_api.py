"""The runner's internal API (``service.api.runner``): a job-scoped token records what its own
job ran — nothing else, and never less than that.

Driven over real HTTP (in-process) on a real database, with an orchestrator that only records
the submissions it gets (a test double: the Ray path is in tests/e2e).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load, save

from service.api import create_app
from service.orchestration import JobState, Submission

from .conftest import OPERATOR_KEY, Api, bearer, make_spec


@dataclass
class RecordingOrchestrator:
    """Records submissions; a job's state is what a test puts in ``states`` (else queued)."""

    submitted: dict[int, Submission] = field(default_factory=dict)
    states: dict[int, JobState] = field(default_factory=dict)
    dashboard_url: str | None = None

    def submit(self, submission: Submission) -> None:
        self.submitted[submission.job_id] = submission

    def status(self, job_id: int) -> JobState:
        return self.states.get(job_id, JobState.QUEUED)

    def cancel(self, job_id: int) -> None:
        pass

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {}


@pytest.fixture
def runs(settings) -> Iterator[tuple[Api, RecordingOrchestrator]]:
    orchestrator = RecordingOrchestrator()
    with TestClient(create_app(settings, orchestrator)) as client:
        yield Api(client, bearer(OPERATOR_KEY)), orchestrator


def _runner(api: Api, orchestrator: RecordingOrchestrator, job_id: int) -> dict[str, str]:
    return bearer(orchestrator.submitted[job_id].token)


def _posted(runs) -> tuple[Api, int, dict[str, Any], dict[str, str], str]:
    """A job posted on a fresh dataset: the API, the dataset's id, the job, its runner's
    headers and its runner API path."""
    api, orchestrator = runs
    dataset = api.register()["id"]
    job = api.client.post("/v1/jobs", headers=api.operator, json=make_spec(dataset)).json()
    return (
        api,
        dataset,
        job,
        _runner(api, orchestrator, job["id"]),
        f"/internal/v1/jobs/{job['id']}",
    )


def _weights() -> bytes:
    return save({"fc.weight": np.ones((2, 3), dtype=np.float32)})


def _run_trials(api: Api, job: int, auth: dict[str, str], scores: list[float]) -> None:
    base = f"/internal/v1/jobs/{job}"
    for index, score in enumerate(scores):
        r = api.client.post(
            f"{base}/attempts",
            headers=auth,
            json={"index": index, "params": {"optimizer.lr": 0.05}},
        )
        assert r.status_code == 201, r.text
        attempt = r.json()["attempt"]
        assert (
            api.client.post(
                f"{base}/attempts/{attempt}/finish",
                headers=auth,
                json={"status": "succeeded", "steps": 23, "score": score},
            ).status_code
            == 204
        )


def test_the_runner_protocol_releases_the_best_trial(runs) -> None:
    api, dataset, job, auth, base = _posted(runs)
    context = api.client.get(base, headers=auth).json()
    assert context["plan"] == job["plan"] and context["dataset"]["source"] == "builtin:digits"
    assert len(context["dataset"]["sha256"]) == 64

    _run_trials(api, job["id"], auth, [0.7, 0.9])
    r = api.client.put(f"{base}/trials/0/model", headers=auth, content=_weights())
    assert r.status_code == 409  # not the best trial: the runner cannot pick another
    r = api.client.post(f"{base}/end", headers=auth, json={"state": "released"})
    assert r.status_code == 409  # nothing released yet
    assert (
        api.client.put(f"{base}/trials/1/model", headers=auth, content=_weights()).status_code
        == 201
    )
    r = api.client.post(f"{base}/end", headers=auth, json={"state": "released"})
    assert r.status_code == 200
    # what the job was charged: both trials, at the job's δ (the dataset's: an rdp default);
    # the dataset counts it through its filter, at least as much
    assert r.json() == {"epsilon": pytest.approx(job["plan"]["epsilon"], rel=1e-3), "delta": 1e-5}
    assert r.json()["epsilon"] <= api.budget(dataset)["spent"]
    done = api.client.get(f"/v1/jobs/{job['id']}", headers=api.operator).json()
    assert done["status"] == "released"
    model = api.client.get(f"/v1/jobs/{job['id']}/model", headers=api.operator)
    size = int.from_bytes(model.content[:8], "little")
    metadata = json.loads(model.content[8 : 8 + size])["__metadata__"]
    assert json.loads(metadata["config"])["optimizer"]["lr"] == 0.05
    assert "builtin:digits" not in str(metadata)  # written by the control plane, no source
    assert load(model.content)["fc.weight"].shape == (2, 3)
    budget = api.budget(dataset)
    assert len([e for e in budget["entries"] if e["kind"] == "charge"]) == 2


def test_the_end_answers_what_the_job_was_charged_at_its_own_delta(runs) -> None:
    """A Liu–Talwar job's δ is a share of the dataset's: its charge is stated at the job's δ,
    where it is the plan's bound. The Ray job is named without its trial count (K is drawn
    later), a fixed-K one with it."""
    api, orchestrator = runs
    dataset = api.register(epsilon=10.0)["id"]
    spec = make_spec(dataset, 3.0, accounting="lt", expected_trials=2)
    spec["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    job = api.client.post("/v1/jobs", headers=api.operator, json=spec).json()
    base, auth = f"/internal/v1/jobs/{job['id']}", _runner(api, orchestrator, job["id"])
    assert api.client.post(f"{base}/start", headers=auth).status_code == 204
    r = api.client.post(f"{base}/end", headers=auth, json={"state": "succeeded"})
    assert r.status_code == 200, r.text
    plan = job["plan"]
    assert plan["delta"] < 1e-5
    assert r.json() == {"epsilon": pytest.approx(plan["epsilon"]), "delta": plan["delta"]}
    assert orchestrator.submitted[job["id"]].title == f"dptune job {job['id']} · mlp on digits · lt"
    fixed = api.client.post("/v1/jobs", headers=api.operator, json=make_spec(dataset)).json()
    assert (
        orchestrator.submitted[fixed["id"]].title
        == f"dptune job {fixed['id']} · mlp on digits · rdp · 2 trials"
    )


def test_a_token_is_good_for_its_own_job_only(runs) -> None:
    api, orchestrator = runs
    dataset = api.register()["id"]
    jobs = [
        api.client.post("/v1/jobs", headers=api.operator, json=make_spec(dataset)).json()
        for _ in range(2)
    ]
    mine, other = (j["id"] for j in jobs)
    auth = _runner(api, orchestrator, mine)
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "", {}),
        ("POST", "/start", {}),
        ("POST", "/attempts", {"json": {"index": 0, "params": {}}}),
        ("POST", "/trials/0/fail-open", {}),
        ("PUT", "/trials/0/model", {"content": _weights()}),
        ("POST", "/end", {"json": {"state": "failed"}}),
    ]
    before = api.budget(dataset)
    for method, path, kwargs in calls:
        for headers in (auth, api.operator, bearer("dpr_made-up")):
            r = api.client.request(
                method, f"/internal/v1/jobs/{other}{path}", headers=headers, **kwargs
            )
            assert r.status_code == 404, (method, path, r.text)
        assert (
            api.client.request(method, f"/internal/v1/jobs/{other}{path}", **kwargs).status_code
            == 401
        )
    assert api.budget(dataset) == before  # nothing charged, released or changed
    assert api.client.get(f"/v1/jobs/{other}", headers=api.operator).json()["status"] == "queued"
    # and a runner token is no API key
    assert api.client.get("/v1/jobs", headers=auth).status_code == 401


def test_a_runner_cannot_reduce_a_charge(runs) -> None:
    api, dataset, job, auth, base = _posted(runs)
    _run_trials(api, job["id"], auth, [0.8])
    charged = api.budget(dataset)["spent"]
    assert charged > 0
    # ending the job early settles it: what ran stays charged, later attempts are refused
    assert api.client.post(f"{base}/end", headers=auth, json={"state": "failed"}).status_code == 200
    assert api.budget(dataset)["spent"] == pytest.approx(charged, rel=1e-12)
    r = api.client.post(f"{base}/attempts", headers=auth, json={"index": 1, "params": {}})
    assert r.status_code == 409
    assert api.client.post(f"{base}/trials/0/fail-open", headers=auth).status_code == 204
    assert api.budget(dataset)["spent"] == pytest.approx(charged, rel=1e-12)


NODE = "5f" * 28  # a Ray node id: 28 bytes, hex


@pytest.mark.parametrize("ended_by", ["runner", "orchestrator"])
def test_no_attempt_stays_running_once_its_job_ended(runs, ended_by) -> None:
    """A job that ends while an attempt never reported its end (its process died with the
    job: the Ray job stopped or failed, the driver reported a failure) ends that attempt as
    failed — still charged."""
    api, dataset, job, auth, base = _posted(runs)
    orchestrator = runs[1]
    _run_trials(api, job["id"], auth, [0.8])
    r = api.client.post(
        f"{base}/attempts", headers=auth, json={"index": 1, "params": {}, "node": "<b>x</b>"}
    )
    assert r.status_code == 422 and r.json()["detail"].startswith("node: ")  # nothing charged
    r = api.client.post(
        f"{base}/attempts", headers=auth, json={"index": 1, "params": {}, "node": NODE}
    )
    assert r.status_code == 201, r.text
    attempt = r.json()["attempt"]
    if ended_by == "runner":
        r = api.client.post(f"{base}/end", headers=auth, json={"state": "failed"})
        assert r.status_code == 200
    else:
        orchestrator.states[job["id"]] = JobState.CANCELLED
    done = api.client.get(f"/v1/jobs/{job['id']}", headers=api.operator).json()
    assert done["status"] == ("failed" if ended_by == "runner" else "cancelled")
    trials = api.client.get(f"/v1/jobs/{job['id']}/trials", headers=api.operator).json()
    first, second = trials
    assert first["status"] == "succeeded" and first["attempts"][0]["status"] == "succeeded"
    (open_attempt,) = second["attempts"]
    assert open_attempt["node"] == NODE
    assert open_attempt["status"] == second["status"] == "failed"
    ended = datetime.fromisoformat(open_attempt["ended_at"])
    assert ended == datetime.fromisoformat(done["finished_at"])
    charges = [e for e in api.budget(dataset)["entries"] if e["kind"] == "charge"]
    assert len(charges) == 2  # both attempts touched data
    # a late report of the dead attempt (a straggling process) changes nothing
    r = api.client.post(
        f"{base}/attempts/{attempt}/finish",
        headers=auth,
        json={"status": "succeeded", "steps": 3, "score": 0.99},
    )
    assert r.status_code == 204
    assert api.client.get(f"/v1/jobs/{job['id']}/trials", headers=api.operator).json() == trials


def test_the_runners_client_speaks_the_api(settings) -> None:
    """``runner.client.ControlPlane`` against the API on a real port."""
    from runner.client import AttemptRefused, ControlPlane
    from service.api.server import BackgroundServer, free_port

    orchestrator = RecordingOrchestrator()
    with (
        BackgroundServer(create_app(settings, orchestrator), free_port()) as server,
        TestClient(create_app(settings, orchestrator)) as client,
    ):
        api = Api(client, bearer(OPERATOR_KEY))
        dataset = api.register()["id"]
        spec = make_spec(dataset)
        spec["search_space"] = {"optimizer.lr": {"grid": [0.05]}}
        job = client.post("/v1/jobs", headers=api.operator, json=spec).json()
        control = ControlPlane(server.url, orchestrator.submitted[job["id"]].token, job["id"])
        assert control.context()["spec"]["dataset"] == dataset
        control.start()
        attempt = control.start_attempt(0, {"optimizer.lr": 0.05}, NODE)
        control.progress(
            attempt,
            3,
            [
                {
                    "epoch": 1,
                    "name": "val_accuracy",
                    "value": 0.5,
                    "visibility": "public",
                    "public": True,
                }
            ],
        )
        for _ in range(2):  # a retried call (its first answer lost) counts once
            control.finish(attempt, "succeeded", 23, 0.75)
        with pytest.raises(AttemptRefused):
            control.start_attempt(5, {})  # outside the plan
        for _ in range(2):
            control.upload_model(0, _weights())
            epsilon, delta = control.end("released")
            # one trial's attempt at the job's δ; the dataset counts at least as much
            assert epsilon <= api.budget(dataset)["spent"] and delta == 1e-5
        assert (
            client.get(f"/v1/jobs/{job['id']}", headers=api.operator).json()["status"] == "released"
        )
        (trial,) = client.get(f"/v1/jobs/{job['id']}/trials", headers=api.operator).json()
        assert trial["steps"] == 23 and trial["attempts"][0]["node"] == NODE
        assert len([e for e in api.budget(dataset)["entries"] if e["kind"] == "charge"]) == 1
        with pytest.raises(RuntimeError, match="404"):
            ControlPlane(server.url, "dpr_wrong", job["id"]).context()


def test_the_runners_client_waits_for_a_restarting_control_plane(settings) -> None:
    """While the service is down (killed, restarting) the runner's calls are retried with
    backoff — for a while: then they fail."""
    from runner.client import ControlPlane
    from service.api.server import BackgroundServer, free_port

    orchestrator = RecordingOrchestrator()
    with TestClient(create_app(settings, orchestrator)) as client:
        dataset = Api(client, bearer(OPERATOR_KEY)).register()["id"]
        job = client.post("/v1/jobs", headers=bearer(OPERATOR_KEY), json=make_spec(dataset))
    job_id = job.json()["id"]
    token = orchestrator.submitted[job_id].token
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    began = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        ControlPlane(url, token, job_id, patience_s=2).context()
    assert 1.5 <= time.monotonic() - began < 10  # retried until its patience ran out

    server = BackgroundServer(create_app(settings, orchestrator), port)
    restart = threading.Timer(2.0, server.__enter__)
    restart.start()
    try:
        began = time.monotonic()
        assert ControlPlane(url, token, job_id, patience_s=60).context()["job_id"] == job_id
        assert time.monotonic() - began >= 2.0
    finally:
        restart.join()
        server.__exit__()
