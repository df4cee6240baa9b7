"""The runner's internal API (``service.api.runner``): a job-scoped token records what its own
job ran — nothing else, and never less than that.

Driven over real HTTP (in-process) on a real database, with an orchestrator that only records
the submissions it gets (a test double: the Ray path is in tests/e2e).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load, save

from service.api import create_app
from service.orchestration import JobState, Submission

from .conftest import OPERATOR_KEY, Api, bearer, make_spec


@dataclass
class RecordingOrchestrator:
    submitted: dict[int, Submission] = field(default_factory=dict)
    dashboard_url: str | None = None

    def submit(self, submission: Submission) -> None:
        self.submitted[submission.job_id] = submission

    def status(self, job_id: int) -> JobState:
        return JobState.QUEUED

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
    api, orchestrator = runs
    dataset = api.register()["id"]
    job = api.client.post("/v1/jobs", headers=api.operator, json=make_spec(dataset)).json()
    auth = _runner(api, orchestrator, job["id"])
    base = f"/internal/v1/jobs/{job['id']}"
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
    assert (
        api.client.post(f"{base}/end", headers=auth, json={"state": "released"}).status_code == 204
    )
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
    api, orchestrator = runs
    dataset = api.register()["id"]
    job = api.client.post("/v1/jobs", headers=api.operator, json=make_spec(dataset)).json()
    auth = _runner(api, orchestrator, job["id"])
    base = f"/internal/v1/jobs/{job['id']}"
    _run_trials(api, job["id"], auth, [0.8])
    charged = api.budget(dataset)["spent"]
    assert charged > 0
    # ending the job early settles it: what ran stays charged, later attempts are refused
    assert api.client.post(f"{base}/end", headers=auth, json={"state": "failed"}).status_code == 204
    assert api.budget(dataset)["spent"] == pytest.approx(charged, rel=1e-12)
    r = api.client.post(f"{base}/attempts", headers=auth, json={"index": 1, "params": {}})
    assert r.status_code == 409
    assert api.client.post(f"{base}/trials/0/fail-open", headers=auth).status_code == 204
    assert api.budget(dataset)["spent"] == pytest.approx(charged, rel=1e-12)


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
        attempt = control.start_attempt(0, {"optimizer.lr": 0.05})
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
        control.finish(attempt, "succeeded", 23, 0.75)
        with pytest.raises(AttemptRefused):
            control.start_attempt(5, {})  # outside the plan
        control.upload_model(0, _weights())
        control.end("released")
        assert (
            client.get(f"/v1/jobs/{job['id']}", headers=api.operator).json()["status"] == "released"
        )
        with pytest.raises(RuntimeError, match="404"):
            ControlPlane(server.url, "dpr_wrong", job["id"]).context()
