"""Under random stopping the analyst learns nothing about the number of trials K beyond the
released trial (docs/design.md, invariant 11), and ``privacy.hold_release`` hides when the job
ended. The runner is simulated with the control-plane calls the Ray driver makes
(workers/job.py, workers/trainable.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.orm import Session

from core import accounting
from service import ledger, lifecycle, visibility
from service.api import create_app
from service.attempts import finish_attempt, record_progress, release_model, start_attempt
from service.db import Job
from service.orchestration import JobState, Orchestrator, Submission
from service.settings import Settings

OPERATOR_KEY = "dpt_views-operator-key-0123456789"
TRIAL_SECONDS = 0.02  # how long a simulated trial runs: K = 5 takes five times as long
BEST = {"optimizer.lr": 0.2}  # the released trial, the same whatever K
BEST_SCORE = 0.9
WEIGHTS = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}


@dataclass
class Service:
    client: TestClient
    data_path: Path
    operator: dict[str, str]
    analyst: dict[str, str]
    dataset: int

    def session(self) -> Session:
        return self.client.app.state.sessions()

    def submit(self, body: dict[str, Any]) -> int:
        r = self.client.post("/v1/jobs", headers=self.analyst, json=body)
        assert r.status_code == 202, r.text
        return r.json()["id"]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def fresh(tmp_path) -> Iterator[Callable[[str], Service]]:
    """Starts a service of its own (SQLite; the no-op orchestrator unless given one, polled
    every ``poll_s`` if given) with a dataset and an analyst key."""
    with ExitStack() as stack:

        def start(
            name: str, orchestrator: Orchestrator | None = None, poll_s: float | None = None
        ) -> Service:
            settings = Settings(
                data_dir=tmp_path / name, database_url=None, operator_key=OPERATOR_KEY
            )
            app = create_app(settings, orchestrator, poll_s)
            client = stack.enter_context(TestClient(app))
            operator = _bearer(OPERATOR_KEY)
            r = client.post(
                "/v1/datasets",
                headers=operator,
                json={"name": "digits", "source": "builtin:digits", "epsilon": 4.0, "delta": 1e-5},
            )
            assert r.status_code == 201, r.text
            dataset = r.json()["id"]
            r = client.post(
                "/v1/keys",
                headers=operator,
                json={"name": "ana", "role": "analyst", "datasets": [dataset]},
            )
            assert r.status_code == 201, r.text
            return Service(
                client, settings.data_path, operator, _bearer(r.json()["secret"]), dataset
            )

        yield start


def lt_spec(spec: Callable[..., dict[str, Any]], dataset: int, **privacy: Any) -> dict:
    body = spec(dataset, epsilon=1.8, accounting="lt", expected_trials=3, delta=2e-7, **privacy)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.1, 0.2]}}
    return body


def _metrics(value: float) -> list[dict[str, Any]]:
    return [
        {"name": "train_loss", "value": 1 - value, "epoch": 1, "public": False},
        {"name": "val_accuracy", "value": value, "epoch": 1, "public": True},
    ]


def run_trial(
    svc: Service,
    job_id: int,
    index: int,
    params: dict,
    score: float | None,
    status: str = "succeeded",
) -> None:
    """One trial as runner.trainable.run_candidate records it."""
    with svc.session() as session:
        attempt = start_attempt(session, job_id, index, params)
        time.sleep(TRIAL_SECONDS)
        record_progress(session, attempt, 23, _metrics(score or 0.0))
        finish_attempt(session, attempt, status, 23, score)


def release(svc: Service, job_id: int, best: int) -> None:
    """runner.driver._release_best and the driver's last state change."""
    with svc.session() as session:
        trial = next(t for t in session.get(Job, job_id).trials if t.index == best)
        release_model(
            session,
            svc.data_path,
            trial.id,
            WEIGHTS,
            {"model": {"name": "mlp"}},
            {"num_classes": 10, "input_shape": [64]},
        )
        lifecycle.apply_state(session, job_id, JobState.RELEASED)


def set_state(svc: Service, job_id: int, state: JobState) -> None:
    with svc.session() as session:
        lifecycle.apply_state(session, job_id, state)


def analyst_view(svc: Service, job_id: int) -> dict[str, Any]:
    """Everything the analyst can read about the job, less the job's creation time (the
    analyst's own submission)."""
    c, ana = svc.client, svc.analyst
    job = c.get(f"/v1/jobs/{job_id}", headers=ana).json()
    listed = c.get("/v1/jobs", headers=ana).json()
    for j in (job, *listed):
        j.pop("created_at")
    return {
        "job": job,
        "jobs": listed,
        "trials": c.get(f"/v1/jobs/{job_id}/trials", headers=ana).json(),
        "model": model_view(c.get(f"/v1/jobs/{job_id}/model", headers=ana)),
        "budget": c.get(f"/v1/datasets/{svc.dataset}/budget", headers=ana).json(),
    }


def model_view(r: httpx.Response) -> tuple[int, Any, dict[str, str]]:
    """The model response: its status, the file's header (parsed: safetensors writes its
    metadata in no fixed order, so the bytes and their hash vary from file to file) and
    data, and the response headers but the date and the hash."""
    if r.status_code != 200:
        return r.status_code, r.json(), {}
    size = int.from_bytes(r.content[:8], "little")
    content = (json.loads(r.content[8 : 8 + size]), r.content[8 + size :])
    varying = {"date", "etag", "x-dptune-sha256"}
    return 200, content, {k: v for k, v in r.headers.items() if k not in varying}


def test_analyst_view_does_not_depend_on_k(fresh, spec):
    """Two lt jobs, K = 1 and K = 5, on two fresh services: same released trial, so the
    analyst must see the same thing at every stage."""
    runs = {k: fresh(f"k{k}") for k in (1, 5)}
    ids = {k: svc.submit(lt_spec(spec, svc.dataset)) for k, svc in runs.items()}
    stages: dict[int, list[dict[str, Any]]] = {1: [], 5: []}
    for k, svc in runs.items():
        job_id = ids[k]
        stages[k].append(analyst_view(svc, job_id))
        set_state(svc, job_id, JobState.RUNNING)  # the driver, before it draws K
        stages[k].append(analyst_view(svc, job_id))
        best = k // 2
        for index in range(k):
            if index == best:
                run_trial(svc, job_id, index, BEST, BEST_SCORE)
            else:
                run_trial(svc, job_id, index, {"optimizer.lr": 0.05}, 0.5 + index / 100)
        stages[k].append(analyst_view(svc, job_id))
        release(svc, job_id, best)
        stages[k].append(analyst_view(svc, job_id))

    for one, five in zip(stages[1], stages[5], strict=True):
        assert one == five
    final = stages[5][-1]
    assert final["job"]["status"] == "released" and final["job"]["released"]
    assert final["job"]["started_at"] is None and final["job"]["finished_at"] is None
    assert final["job"]["progress"] == {
        "trials_done": None,
        "trials_total": "random",
        "best_score": BEST_SCORE,
    }
    assert final["trials"] == [
        {
            "index": None,
            "params": BEST,
            "score": BEST_SCORE,
            "metrics": _metrics(BEST_SCORE)[1:],
            "thresholds": None,
            "released": True,
            "status": None,
            "steps": None,
            "attempts": None,
            "epsilon": None,
            "score_std": final["job"]["plan"]["score_std"],  # the plan's, whatever K
        }
    ]
    assert final["job"]["plan"]["score_std"] > 0
    assert final["model"][0] == 200 and "last-modified" not in final["model"][2]
    assert [(e["kind"], e["created_at"]) for e in final["budget"]["entries"]] == [
        ("reservation", None),
        ("charge", None),
    ]


def test_operator_sees_everything(fresh, spec):
    svc = fresh("op")
    job_id = svc.submit(lt_spec(spec, svc.dataset))
    set_state(svc, job_id, JobState.RUNNING)
    for index in range(5):
        run_trial(svc, job_id, index, {"optimizer.lr": 0.05}, 0.5 + index / 10)
    release(svc, job_id, 4)
    c, op = svc.client, svc.operator
    job = c.get(f"/v1/jobs/{job_id}", headers=op).json()
    assert job["status"] == "released" and job["started_at"] and job["finished_at"]
    assert job["progress"]["trials_done"] == 5
    trials = c.get(f"/v1/jobs/{job_id}/trials", headers=op).json()
    assert [t["index"] for t in trials] == [0, 1, 2, 3, 4]
    assert all(t["attempts"] and len(t["metrics"]) == 2 for t in trials)
    entries = c.get(f"/v1/datasets/{svc.dataset}/budget", headers=op).json()["entries"]
    # no zero-amount release row: the whole bound was charged when the first trial started
    assert [e["kind"] for e in entries] == ["reservation", "charge"]
    assert all(e["created_at"] and e["job"] == job_id for e in entries)


def test_legacy_zero_release_rows_are_hidden_from_analysts(fresh, spec):
    """Ledgers written before settle stopped writing them hold a zero release row dated by
    the job's end."""
    svc = fresh("legacy")
    job_id = svc.submit(lt_spec(spec, svc.dataset))
    set_state(svc, job_id, JobState.RUNNING)
    run_trial(svc, job_id, 0, BEST, BEST_SCORE)
    release(svc, job_id, 0)
    budget = f"/v1/datasets/{svc.dataset}/budget"
    before = svc.client.get(budget, headers=svc.analyst).json()
    with svc.session() as session:
        ledger.append(
            session,
            session.get(Job, job_id),
            "release",
            f"job:{job_id}:release",
            ledger.amount(accounting.Charge()),
            "unused reservation",
        )
        session.commit()
    assert svc.client.get(budget, headers=svc.analyst).json() == before
    kinds = [e["kind"] for e in svc.client.get(budget, headers=svc.operator).json()["entries"]]
    assert kinds == ["reservation", "charge", "release"]


def test_ended_without_a_model_shows_failed(fresh, spec):
    svc = fresh("nomodel")
    job_id = svc.submit(lt_spec(spec, svc.dataset))
    set_state(svc, job_id, JobState.RUNNING)
    run_trial(svc, job_id, 0, BEST, None, status="failed")
    set_state(svc, job_id, JobState.SUCCEEDED)  # the driver: no trial finished
    c = svc.client
    assert c.get(f"/v1/jobs/{job_id}", headers=svc.analyst).json()["status"] == "failed"
    assert c.get(f"/v1/jobs/{job_id}", headers=svc.operator).json()["status"] == "succeeded"
    r = c.get(f"/v1/jobs/{job_id}/model", headers=svc.analyst)
    assert r.status_code == 409 and "status failed" in r.text


def _hold_until(svc: Service, job_id: int) -> datetime:
    """started_at + cap × (trial 0's first attempt), from what the operator sees."""
    c, op = svc.client, svc.operator
    job = c.get(f"/v1/jobs/{job_id}", headers=op).json()
    first = c.get(f"/v1/jobs/{job_id}/trials", headers=op).json()[0]["attempts"][0]
    duration = datetime.fromisoformat(first["ended_at"]) - datetime.fromisoformat(
        first["started_at"]
    )
    return datetime.fromisoformat(job["started_at"]) + job["plan"]["trials"]["max"] * duration


def test_hold_release(fresh, spec, monkeypatch):
    svc = fresh("hold")
    c, ana = svc.client, svc.analyst
    queued = svc.submit(lt_spec(spec, svc.dataset, hold_release=True))
    r = c.post(f"/v1/jobs/{queued}/cancel", headers=ana)  # no K drawn yet: nothing to hide
    assert r.status_code == 202 and r.json()["status"] == "cancelled"

    job_id = svc.submit(lt_spec(spec, svc.dataset, hold_release=True))
    set_state(svc, job_id, JobState.RUNNING)
    far = visibility.now() + timedelta(days=365)
    monkeypatch.setattr(visibility, "now", lambda: far)  # trial 0 not timed yet: held
    r = c.post(f"/v1/jobs/{job_id}/cancel", headers=ana)
    assert r.status_code == 409 and r.json()["detail"].startswith("job: ")
    assert "hold_release" in r.text
    run_trial(svc, job_id, 0, {"optimizer.lr": 0.05}, 0.5)
    run_trial(svc, job_id, 1, BEST, BEST_SCORE)
    release(svc, job_id, 1)
    until = _hold_until(svc, job_id)

    monkeypatch.setattr(visibility, "now", lambda: until - timedelta(microseconds=1))
    held = analyst_view(svc, job_id)
    assert held["job"]["status"] == "running" and not held["job"]["released"]
    assert held["job"]["progress"]["best_score"] is None
    assert held["jobs"][0]["status"] == "running"
    assert held["trials"] == []
    assert held["model"][0] == 409 and "status running" in held["model"][1]["detail"]
    assert c.post(f"/v1/jobs/{job_id}/cancel", headers=ana).status_code == 409
    assert c.get(f"/v1/jobs/{job_id}", headers=svc.operator).json()["status"] == "released"

    monkeypatch.setattr(visibility, "now", lambda: until)
    shown = analyst_view(svc, job_id)
    assert shown["job"]["status"] == "released" and shown["job"]["released"]
    assert [t["params"] for t in shown["trials"]] == [BEST]
    assert shown["model"][0] == 200


def test_hold_release_times_trials_at_the_longest_shape(fresh, spec, monkeypatch):
    """Attack: with batch size searched, trial 0 may draw a short shape; holding only for cap ×
    its duration would end the hold before a job of many long trials ends, and the time the
    model appears would tell K. The hold scales trial 0 to the longest shape's steps."""
    svc = fresh("shapes")
    body = lt_spec(spec, svc.dataset, hold_release=True)
    body["search_space"] = {"batch_size": {"values": [32, 128]}}
    job_id = svc.submit(body)
    set_state(svc, job_id, JobState.RUNNING)
    short = {"batch_size": 128}
    run_trial(svc, job_id, 0, short, 0.5)
    run_trial(svc, job_id, 1, {"batch_size": 32}, BEST_SCORE)
    release(svc, job_id, 1)
    plan = svc.client.get(f"/v1/jobs/{job_id}", headers=svc.operator).json()["plan"]
    steps = {s["batch_size"]: s["steps"] for s in plan["shapes"]}
    assert steps[32] > 3 * steps[128]
    started = _hold_until(svc, job_id) - plan["trials"]["max"] * _first_duration(svc, job_id)
    until = started + plan["trials"]["max"] * _first_duration(svc, job_id) * (
        steps[32] / steps[128]
    )
    monkeypatch.setattr(visibility, "now", lambda: until - timedelta(microseconds=2))
    assert analyst_view(svc, job_id)["job"]["status"] == "running"
    monkeypatch.setattr(visibility, "now", lambda: until + timedelta(microseconds=2))
    assert analyst_view(svc, job_id)["job"]["status"] == "released"


def _first_duration(svc: Service, job_id: int) -> timedelta:
    first = svc.client.get(f"/v1/jobs/{job_id}/trials", headers=svc.operator).json()[0]
    attempt = first["attempts"][0]
    return datetime.fromisoformat(attempt["ended_at"]) - datetime.fromisoformat(
        attempt["started_at"]
    )


def test_hold_without_trial_zero_shows_the_end(fresh, spec):
    """K = 0 (Poisson K under ps): no trial to time, so the job is not held; it shows as
    failed — the mechanism's output for K = 0."""
    svc = fresh("k0")
    body = spec(
        svc.dataset,
        epsilon=2.0,
        accounting="ps",
        mean=3,
        eta="poisson",
        max_trials=30,
        hold_release=True,
    )
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    job_id = svc.submit(body)
    set_state(svc, job_id, JobState.RUNNING)
    job = svc.client.get(f"/v1/jobs/{job_id}", headers=svc.analyst).json()
    assert job["status"] == "running"
    set_state(svc, job_id, JobState.SUCCEEDED)
    job = svc.client.get(f"/v1/jobs/{job_id}", headers=svc.analyst).json()
    assert job["status"] == "failed" and not job["released"]


@pytest.mark.parametrize("endpoint", ["/v1/plans", "/v1/jobs"])
def test_hold_release_only_under_random_stopping(api, dataset, ana, spec, endpoint):
    r = api.client.post(endpoint, headers=ana, json=spec(dataset["id"], hold_release=True))
    assert r.status_code == 422
    assert r.json()["detail"] == ("privacy.hold_release: not a parameter of accounting 'rdp'"), (
        r.text
    )
    assert api.budget(dataset["id"])["entries"] == []


def test_the_bound_is_charged_before_k_is_drawn(fresh, spec):
    """The whole bound is charged when the job is marked running, before the driver draws
    K: whether a first trial ever starts (not when K = 0) changes nothing in the budget."""
    svc = fresh("k0")
    job_id = svc.submit(lt_spec(spec, svc.dataset))
    set_state(svc, job_id, JobState.RUNNING)
    budget = f"/v1/datasets/{svc.dataset}/budget"
    before = svc.client.get(budget, headers=svc.analyst).json()
    assert before["reserved"] == pytest.approx(0.0, abs=1e-12) and before["spent"] > 0
    with svc.session() as session:
        start_attempt(session, job_id, 0, BEST)
    assert svc.client.get(budget, headers=svc.analyst).json() == before


@dataclass
class Cluster:
    """An orchestrator that runs nothing and records every call: whether a job's Ray job
    still runs is ``state``, as the Ray Jobs API would answer; ``tokens`` are the runner
    tokens it was handed, by job id."""

    state: JobState = JobState.RUNNING
    calls: list[str] = field(default_factory=list)
    tokens: dict[int, str] = field(default_factory=dict)
    dashboard_url: str | None = None

    def check(self) -> None:
        self.calls.append("check")

    def submit(self, submission: Submission) -> None:
        self.calls.append("submit")
        self.tokens[submission.job_id] = submission.token

    def status(self, job_id: int) -> JobState:
        self.calls.append("status")
        return self.state

    def cancel(self, job_id: int) -> None:
        self.calls.append("cancel")

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        self.calls.append("reconcile")
        return dict.fromkeys(job_ids, self.state)


@contextmanager
def statements(svc: Service) -> Iterator[list[str]]:
    """The SQL statements the service runs meanwhile, in order."""
    engine = svc.client.app.state.sessions.kw["bind"]
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


#: every route an analyst can reach a job by, or its ledger rows: (method, path)
ROUTES = [
    ("GET", "/v1/jobs/{job}"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{job}/trials"),
    ("GET", "/v1/jobs/{job}/report.png"),
    ("GET", "/v1/jobs/{job}/model"),
    ("GET", "/v1/datasets/{dataset}/budget"),
    ("POST", "/v1/jobs/{job}/cancel"),
]


def handling(svc: Service, cluster: Cluster, method: str, path: str) -> dict[str, Any]:
    """What the service does for one analyst request: its answer, the SQL it runs and the
    orchestrator calls it makes."""
    del cluster.calls[:]
    with statements(svc) as sql:
        r = svc.client.request(method, path, headers=svc.analyst)
    return {"status": r.status_code, "body": r.content, "sql": sql, "ray": list(cluster.calls)}


def random_stopping_spec(
    spec: Callable[..., dict[str, Any]], dataset: int, accounting: str, hold: bool
) -> dict[str, Any]:
    if accounting == "lt":
        return lt_spec(spec, dataset, hold_release=hold)
    body = spec(dataset, epsilon=2.0, accounting="ps", mean=3, eta=1, hold_release=hold)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    return body


@pytest.mark.parametrize("trial_zero", ["ended", "running"])
@pytest.mark.parametrize("accounting", ["lt", "ps"])
def test_held_job_reads_do_the_same_work_before_and_after_its_end(
    fresh, spec, monkeypatch, accounting, trial_zero
):
    """Attack (issue 39, finding 4): reading a running job asked Ray, reading an ended one
    did not — the response time showed the end that ``hold_release`` hides. Every analyst
    route must answer the same, with the same SQL and no orchestrator call, before the job
    ends and after (while held): after trial 0 (released, then), or during it (the job
    fails, which ends trial 0's attempt)."""
    cluster = Cluster()
    svc = fresh("work", cluster)
    job_id = svc.submit(random_stopping_spec(spec, svc.dataset, accounting, hold=True))
    held = visibility.now()  # before the job starts: before its hold ends, whatever K
    monkeypatch.setattr(visibility, "now", lambda: held)
    set_state(svc, job_id, JobState.RUNNING)
    if trial_zero == "ended":
        run_trial(svc, job_id, 0, {"optimizer.lr": 0.05}, 0.5)
        run_trial(svc, job_id, 1, BEST, BEST_SCORE)
    else:
        with svc.session() as session:
            start_attempt(session, job_id, 0, BEST)
    routes = [(m, path.format(job=job_id, dataset=svc.dataset)) for m, path in ROUTES]
    running = [handling(svc, cluster, *route) for route in routes]
    if trial_zero == "ended":
        release(svc, job_id, 1)
    else:
        set_state(svc, job_id, JobState.FAILED)
    cluster.state = JobState.SUCCEEDED
    ended = [handling(svc, cluster, *route) for route in routes]
    for route, before, after in zip(routes, running, ended, strict=True):
        assert before["ray"] == after["ray"] == [], route
        assert before == after, route


@pytest.mark.parametrize("accounting", ["lt", "ps"])
@pytest.mark.parametrize("hold", [False, True])
def test_analysts_reads_never_ask_ray(fresh, spec, accounting, hold):
    """An analyst's read of a random-stopping job asks the orchestrator nothing; an
    operator's still does (and records what it hears); an rdp job's owner's too."""
    cluster = Cluster()
    svc = fresh("ray", cluster)
    job_id = svc.submit(random_stopping_spec(spec, svc.dataset, accounting, hold))
    set_state(svc, job_id, JobState.RUNNING)
    run_trial(svc, job_id, 0, BEST, BEST_SCORE)
    for method, path in ROUTES[:-1]:  # a cancel asks Ray to stop the job
        route = path.format(job=job_id, dataset=svc.dataset)
        assert handling(svc, cluster, method, route)["ray"] == []
    del cluster.calls[:]
    cluster.state = JobState.FAILED
    r = svc.client.get(f"/v1/jobs/{job_id}", headers=svc.operator)
    assert cluster.calls == ["status"] and r.json()["status"] == "failed"

    fixed = svc.submit(spec(svc.dataset, epsilon=0.5))
    cluster.state = JobState.RUNNING
    assert handling(svc, cluster, "GET", f"/v1/jobs/{fixed}")["ray"] == ["status"]


def test_the_poller_shows_a_held_end_once_the_hold_passed(fresh, spec, monkeypatch):
    """With analysts' reads not asking Ray, a job whose Ray job died without its runner's end
    call is settled by the service's poller; the analyst sees it ``failed`` once the hold
    passed (``running`` before)."""
    cluster = Cluster()
    svc = fresh("poll", cluster, poll_s=0.02)
    job_id = svc.submit(lt_spec(spec, svc.dataset, hold_release=True))
    eventually(lambda: _status(svc, job_id) == JobState.RUNNING)  # the poller heard it
    run_trial(svc, job_id, 0, BEST, BEST_SCORE)
    cluster.state = JobState.FAILED
    eventually(lambda: _status(svc, job_id) == JobState.FAILED)
    read = f"/v1/jobs/{job_id}"
    with svc.session() as session:
        until = visibility.hold_until(session.get(Job, job_id))
    assert until is not None
    monkeypatch.setattr(visibility, "now", lambda: until - timedelta(microseconds=1))
    assert svc.client.get(read, headers=svc.analyst).json()["status"] == "running"
    monkeypatch.setattr(visibility, "now", lambda: until)
    assert svc.client.get(read, headers=svc.analyst).json()["status"] == "failed"


def _status(svc: Service, job_id: int) -> str:
    with svc.session() as session:
        return session.get(Job, job_id).status


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_runner_holds_as_long_as_the_analyst_view(fresh, spec, monkeypatch):
    """``GET /internal/v1/jobs/{id}/hold``: the seconds until the analyst may see the end
    (``visibility.hold_until``), by the control plane's clock; 0 after, and for a job that
    does not hold."""
    cluster = Cluster()
    svc = fresh("hold-api", cluster)
    held = svc.submit(lt_spec(spec, svc.dataset, hold_release=True))
    free = svc.submit(lt_spec(spec, svc.dataset))
    for job_id in (held, free):
        set_state(svc, job_id, JobState.RUNNING)
        run_trial(svc, job_id, 0, BEST, BEST_SCORE)

    def hold_s(job_id: int) -> float:
        token = {"Authorization": f"Bearer {cluster.tokens[job_id]}"}
        r = svc.client.get(f"/internal/v1/jobs/{job_id}/hold", headers=token)
        assert r.status_code == 200, r.text
        return r.json()["seconds"]

    with svc.session() as session:
        until = visibility.hold_until(session.get(Job, held))
    assert until is not None
    monkeypatch.setattr(visibility, "now", lambda: until - timedelta(seconds=7.5))
    assert hold_s(held) == 7.5 and hold_s(free) == 0
    monkeypatch.setattr(visibility, "now", lambda: until + timedelta(seconds=1))
    assert hold_s(held) == 0
    other = {"Authorization": f"Bearer {cluster.tokens[free]}"}
    assert svc.client.get(f"/internal/v1/jobs/{held}/hold", headers=other).status_code == 404
