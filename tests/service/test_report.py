"""The job report (``GET /v1/jobs/{id}/report.png``, ``dptune report``): it draws the trials and
the ledger the caller's JSON views show, and nothing more (docs/design.md, invariants 4 and 11).
Jobs are simulated with the control-plane calls the Ray runner makes (runner/trainable.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from matplotlib.collections import PathCollection
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from service import ledger, lifecycle, reporting
from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.attempts import finish_attempt, record_progress, release_model, start_attempt
from service.auth import Principal, authenticate
from service.cli import app as cli
from service.db import Dataset, Job
from service.orchestration import JobState
from service.settings import Settings

OPERATOR_KEY = "dpt_report-operator-key-0123456789"
PNG = b"\x89PNG\r\n\x1a\n"


@dataclass
class Service:
    client: httpx.Client
    sessions: Callable[[], Session]
    data_path: Path
    keys: dict[str, str]  # role → secret
    dataset: int

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def principal(self, role: str) -> Principal:
        with self.sessions() as session:
            caller = authenticate(session, self.keys[role])
        assert caller is not None
        return caller

    def submit(self, body: dict[str, Any]) -> int:
        r = self.client.post("/v1/jobs", headers=self.headers("analyst"), json=body)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def state(self, job_id: int, state: JobState) -> None:
        with self.sessions() as session:
            lifecycle.apply_state(session, job_id, state)

    def trial(self, job_id: int, index: int, params: dict[str, Any], score: float) -> None:
        """One trial as runner.trainable records it."""
        with self.sessions() as session:
            attempt = start_attempt(session, job_id, index, params)
            metrics = [{"name": "val_accuracy", "value": score, "epoch": 1, "public": True}]
            record_progress(session, attempt, 23, metrics)
            finish_attempt(session, attempt, "succeeded", 23, score)

    def release(self, job_id: int, index: int) -> None:
        """runner.driver's release of the best trial and its last state change."""
        with self.sessions() as session:
            trial = next(t for t in session.get(Job, job_id).trials if t.index == index)
            weights = {"fc.weight": np.zeros((2, 3), dtype=np.float32)}
            info = {"num_classes": 10, "input_shape": [64]}
            release_model(session, self.data_path, trial.id, weights, {}, info)
            lifecycle.apply_state(session, job_id, JobState.RELEASED)

    def report(self, role: str, job_id: int) -> bytes:
        r = self.client.get(f"/v1/jobs/{job_id}/report.png", headers=self.headers(role))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "image/png" and r.content.startswith(PNG)
        return r.content

    def collect(self, role: str, job_id: int) -> reporting.Report:
        with self.sessions() as session:
            return reporting.collect(session, session.get(Job, job_id), self.principal(role))


def start_service(settings: Settings, client: httpx.Client, app: FastAPI) -> Service:
    """A dataset with a budget of ε = 4, and two analysts of it, on a started ``app``."""
    assert settings.operator_key is not None
    keys = {"operator": settings.operator_key.get_secret_value()}
    operator = {"Authorization": f"Bearer {keys['operator']}"}
    r = client.post(
        "/v1/datasets",
        headers=operator,
        json={"name": "digits", "source": "builtin:digits", "epsilon": 4.0, "delta": 1e-5},
    )
    assert r.status_code == 201, r.text
    dataset = r.json()["id"]
    for role in ("analyst", "other"):
        body = {"name": role, "role": "analyst", "datasets": [dataset]}
        r = client.post("/v1/keys", headers=operator, json=body)
        assert r.status_code == 201, r.text
        keys[role] = r.json()["secret"]
    return Service(client, app.state.sessions, settings.data_path, keys, dataset)


@pytest.fixture
def svc(settings, client) -> Service:
    """The service of conftest's ``client`` (on SQLite and PostgreSQL)."""
    return start_service(settings, client, client.app)


@pytest.fixture
def fresh(tmp_path) -> Iterator[Callable[[str], Service]]:
    """Starts a service of its own (SQLite, a no-op orchestrator) each time it is called."""
    with ExitStack() as stack:

        def start(name: str) -> Service:
            settings = Settings(data_dir=tmp_path / name, operator_key=OPERATOR_KEY)
            app = create_app(settings)
            client = stack.enter_context(TestClient(app))
            return start_service(settings, client, app)

        yield start


def rdp_job(svc: Service, spec: Callable[..., dict[str, Any]]) -> int:
    """A released rdp job over a grid of learning rates spanning two decades."""
    body = spec(svc.dataset, epsilon=1.0)
    body["search_space"] = {"optimizer.lr": {"grid": [0.01, 0.1, 1.0]}}
    job_id = svc.submit(body)
    svc.state(job_id, JobState.RUNNING)
    for index, (lr, score) in enumerate([(0.01, 0.4), (0.1, 0.8), (1.0, 0.6)]):
        svc.trial(job_id, index, {"optimizer.lr": lr}, score)
    svc.release(job_id, 1)
    return job_id


def lt_body(spec: Callable[..., dict[str, Any]], dataset: int) -> dict[str, Any]:
    body = spec(dataset, epsilon=1.8, accounting="lt", expected_trials=3, delta=2e-7)
    body["search_space"] = {
        "optimizer.lr": {"log_uniform": [0.01, 1.0]},
        "method.clipping": {"values": ["abadi", "auto_s"]},
    }
    return body


def test_report_draws_the_trials_and_ledger_the_caller_sees(svc, spec):
    job_id = rdp_job(svc, spec)
    for role in ("operator", "analyst"):
        svc.report(role, job_id)
        report = svc.collect(role, job_id)
        trials = svc.client.get(f"/v1/jobs/{job_id}/trials", headers=svc.headers(role)).json()
        assert [(p.params, p.score, p.released) for p in report.points] == [
            (t["params"], t["score"], t["released"]) for t in trials
        ]
        budget = svc.client.get(
            f"/v1/datasets/{svc.dataset}/budget", headers=svc.headers(role)
        ).json()
        assert [r.kind for r in report.rows] == [e["kind"] for e in budget["entries"]]
        assert all(r.at is not None for r in report.rows)  # rdp rows keep their times
        last = report.rows[-1]
        assert last.spent == pytest.approx(budget["spent"], rel=1e-9)
        assert last.committed == pytest.approx(budget["spent"] + budget["reserved"], rel=1e-9)

    report = svc.collect("analyst", job_id)
    figure = reporting.draw(report)
    lr = figure.axes[0]
    assert lr.get_xlabel() == "optimizer.lr" and lr.get_xscale() == "log"
    trials, released = (c.get_offsets().tolist() for c in _points(lr))
    assert trials == [[0.01, 0.4], [1.0, 0.6]] and released == [[0.1, 0.8]]
    # the private score's release noise, σ_v/(f·N), as error bars around every score
    analyst = svc.headers("analyst")
    plan = svc.client.get(f"/v1/jobs/{job_id}", headers=analyst).json()["plan"]
    n = svc.client.get(f"/v1/datasets/{svc.dataset}", headers=analyst).json()["n"]
    assert report.score_std == plan["score_std"] == pytest.approx(20.0 / (0.1 * n))
    for role in ("operator", "analyst"):  # every trial view carries it
        trials = svc.client.get(f"/v1/jobs/{job_id}/trials", headers=svc.headers(role)).json()
        assert [t["score_std"] for t in trials] == [plan["score_std"]] * 3
    [bars] = lr.containers
    segments = bars.lines[2][0].get_segments()
    ends = [end for s in segments for end in (s[0][1], s[1][1])]
    std = report.score_std
    assert ends == pytest.approx([e for y in (0.4, 0.8, 0.6) for e in (y - std, y + std)])


def _points(ax) -> list[PathCollection]:
    """The scatter plots of an axes (error bars are line collections)."""
    return [c for c in ax.collections if isinstance(c, PathCollection)]


def test_ledger_totals_are_the_budget_after_each_row(svc, spec):
    """The reservation commits the job's cost at once and spends nothing; each attempt's charge
    then spends within that commitment, up to what the budget reports."""
    job_id = rdp_job(svc, spec)
    with svc.sessions() as session:
        dataset = session.get(Dataset, svc.dataset)
        state = ledger.budget(session, dataset)
        entries = ledger.entries_of(session, dataset.id)
        totals = ledger.running_totals(entries, dataset)
        planned = session.get(Job, job_id).plan["epsilon"]
    assert [e.kind for e in entries] == ["reservation"] + ["charge"] * 3 + ["release"]
    spent, committed = zip(*totals, strict=True)
    # the job counts on the dataset by its cost under the filter, at least its own ε
    assert committed == pytest.approx([committed[0]] * 5, rel=1e-9) and committed[0] >= planned
    assert spent[0] == 0 < spent[1] <= spent[2] <= spent[3] == pytest.approx(committed[0])
    assert (spent[-1], committed[-1]) == (state.spent, state.committed)


def test_analyst_report_does_not_depend_on_k(fresh, spec):
    """Two lt jobs, K = 1 and K = 5, with the same released trial: the analyst's report is
    the same picture at every stage, while the operator's shows every trial."""
    runs = {k: fresh(f"k{k}") for k in (1, 5)}
    pictures: dict[int, list[bytes]] = {1: [], 5: []}
    for k, svc in runs.items():
        job_id = svc.submit(lt_body(spec, svc.dataset))
        svc.state(job_id, JobState.RUNNING)
        best = k // 2
        pictures[k].append(svc.report("analyst", job_id))
        for index in range(k):
            params = {"optimizer.lr": 0.3, "method.clipping": "auto_s"}
            if index != best:
                params = {"optimizer.lr": 0.02 * (index + 1), "method.clipping": "abadi"}
            svc.trial(job_id, index, params, 0.9 if index == best else 0.5)
        pictures[k].append(svc.report("analyst", job_id))
        svc.release(job_id, best)
        pictures[k].append(svc.report("analyst", job_id))

    assert pictures[1] == pictures[5]
    analyst = runs[5].collect("analyst", 1)
    assert [(p.index, p.score, p.released) for p in analyst.points] == [(None, 0.9, True)]
    assert [(r.kind, r.at) for r in analyst.rows] == [("reservation", None), ("charge", None)]
    assert len(runs[5].collect("operator", 1).points) == 5
    assert runs[1].report("operator", 1) != runs[5].report("operator", 1)


def test_report_is_for_the_jobs_owner_and_operators(svc, spec):
    job_id = rdp_job(svc, spec)
    url = f"/v1/jobs/{job_id}/report.png"
    assert svc.client.get(url, headers=svc.headers("other")).status_code == 404
    assert svc.client.get(url).status_code == 401
    assert (
        svc.client.get("/v1/jobs/99/report.png", headers=svc.headers("operator")).status_code == 404
    )


def test_cli_writes_the_report(tmp_path, spec):
    settings = Settings(data_dir=tmp_path / "cli", operator_key=OPERATOR_KEY)
    app = create_app(settings)
    with BackgroundServer(app, free_port()) as server, httpx.Client(base_url=server.url) as c:
        svc = start_service(settings, c, app)
        job_id = rdp_job(svc, spec)
        runner = CliRunner()
        out = tmp_path / "report.png"
        args = ["report", str(job_id), "--url", server.url, "-o", str(out)]
        result = runner.invoke(cli, args, env={"DPTUNE_API_KEY": svc.keys["analyst"]})
        assert result.exit_code == 0, result.output
        assert out.read_bytes() == svc.report("analyst", job_id)

        result = runner.invoke(cli, [*args, "--key", svc.keys["other"]])
        assert result.exit_code == 1 and f"404 job {job_id} not found" in result.output
        down = ["report", str(job_id), "--key", "k", "--url", "http://127.0.0.1:9"]
        result = runner.invoke(cli, down)
        assert result.exit_code == 2 and "--url" in result.output


def test_a_job_without_search_space_is_drawn_by_trial():
    """Nothing searched: one panel of scores by trial, the released one at 0 when its index
    is withheld; a total that is not finite is left out of the ledger lines."""
    report = reporting.Report(
        title="job 1",
        score_label="DP score",
        dimensions=[],
        points=[reporting.Point(None, {}, 0.7, True)],
        budget=2.0,
        rows=[
            reporting.Row("reservation", 0.0, 1.0, None, True),
            reporting.Row("charge", float("inf"), float("inf"), None, True),
        ],
    )
    trials, budget = reporting.draw(report).axes
    assert trials.get_xlabel() == "trial"
    assert trials.collections[0].get_offsets().tolist() == [[0.0, 0.7]]
    assert budget.get_xlabel() == "ledger row (times withheld)"
    committed = budget.get_lines()[1].get_ydata()
    assert committed[0] == 1.0 and np.isnan(committed[-1])
    assert reporting.render(report).startswith(PNG)
