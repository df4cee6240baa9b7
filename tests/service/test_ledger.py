"""Charging what ran and releasing only what never touched data (service.ledger.settle and
service.attempts), checked through the budget the API reports."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from opacus.accountants.analysis.rdp import compute_rdp
from safetensors.numpy import load
from sqlalchemy import select

from core.accounting import ORDERS
from service import ledger, lifecycle
from service.api import create_app
from service.attempts import (
    AttemptRefused,
    finish_attempt,
    record_progress,
    release_model,
    start_attempt,
)
from service.db import Job, LedgerEntry
from service.orchestration import JobState

WIDTH = len(ORDERS) + 2  # one route of a ledger vector: the RDP curve, ε, δ


def opacus_curve(plan: dict) -> np.ndarray:
    """One trial's RDP curve over ORDERS (DP-SGD + private score), by Opacus."""
    curve = compute_rdp(
        q=plan["sample_rate"],
        noise_multiplier=plan["noise_multiplier"],
        steps=plan["steps"],
        orders=ORDERS,
    )
    return curve + ORDERS / (2 * plan["validation_noise"] ** 2)


@pytest.fixture
def session(client):
    with client.app.state.sessions() as s:
        yield s


def _rows(session, job: int) -> list[LedgerEntry]:
    query = select(LedgerEntry).where(LedgerEntry.job_id == job).order_by(LedgerEntry.id)
    return list(session.execute(query).scalars())


def test_rdp_charges_attempts_and_releases_the_rest(
    api, dataset, ana, spec, session, filter_epsilon
):
    ds = dataset["id"]
    job = api.client.post("/v1/jobs", headers=ana, json=spec(ds, epsilon=2.0, max_retries=1)).json()
    plan, jid = job["plan"], job["id"]
    assert plan["attempts_reserved"] == 4  # 2 trials, each with one retry reserved

    # the job counts as its curve through the dataset's filter (budget 4): each attempt spends
    # one trial's curve, the reservation commits all four
    trial = opacus_curve(plan)
    first = start_attempt(session, jid, 0, {"optimizer.lr": 0.05})
    [reservation, _] = _rows(session, jid)
    assert reservation.pld_epsilon is None  # route B is route A: the curve
    budget = api.budget(ds)
    assert budget["spent"] == pytest.approx(filter_epsilon(4.0, 1e-5, trial), rel=1e-3)
    committed = budget["spent"] + budget["reserved"]
    assert committed == pytest.approx(filter_epsilon(4.0, 1e-5, 4 * trial), rel=1e-3)
    finish_attempt(session, first, "failed", 3)
    start_attempt(session, jid, 0, {"optimizer.lr": 0.05})  # the reserved retry
    with pytest.raises(AttemptRefused, match="retries"):
        start_attempt(session, jid, 0, {"optimizer.lr": 0.05})
    with pytest.raises(AttemptRefused, match="outside"):
        start_attempt(session, jid, 2, {"optimizer.lr": 0.5})
    start_attempt(session, jid, 1, {"optimizer.lr": 0.2})

    lifecycle.apply_state(session, jid, JobState.SUCCEEDED)
    budget = api.budget(ds)
    assert [e["kind"] for e in budget["entries"]] == ["reservation"] + ["charge"] * 3 + ["release"]
    assert budget["reserved"] == 0
    assert budget["spent"] == pytest.approx(filter_epsilon(4.0, 1e-5, 3 * trial), rel=1e-3)
    rows = _rows(session, jid)
    vec = {
        kind: sum(ledger.entry_amount(r) for r in rows if r.kind == kind)
        for kind in ("reservation", "charge", "release")
    }
    np.testing.assert_allclose(vec["charge"] + vec["release"], vec["reservation"], rtol=1e-12)
    a, b = slice(0, WIDTH), slice(WIDTH, None)  # the ledger's two routes
    np.testing.assert_allclose(vec["release"][a], vec["reservation"][a] / 4, rtol=1e-12)
    np.testing.assert_array_equal(vec["reservation"][b], vec["reservation"][a])  # the curve
    assert [r.pld_epsilon for r in rows] == [None] * 5

    with pytest.raises(AttemptRefused, match="succeeded"):
        start_attempt(session, jid, 1, {"optimizer.lr": 0.2})
    ledger.settle(session, session.get(Job, jid))  # idempotent
    session.commit()
    assert len(_rows(session, jid)) == 5


def test_random_stopping_charges_the_whole_bound_once_started(api, dataset, ana, spec, session):
    body = spec(dataset["id"], epsilon=2.0, accounting="lt", expected_trials=3)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    job = api.client.post("/v1/jobs", headers=ana, json=body).json()
    jid = job["id"]
    start_attempt(session, jid, 0, {"optimizer.lr": 0.05})
    with pytest.raises(AttemptRefused):
        start_attempt(session, jid, 0, {"optimizer.lr": 0.05})  # no retries under lt
    start_attempt(session, jid, 1, {"optimizer.lr": 0.2})
    r = api.client.post(f"/v1/jobs/{jid}/cancel", headers=ana)
    assert r.json()["status"] == "cancelled"
    budget = api.budget(dataset["id"])
    charges = [e for e in budget["entries"] if e["kind"] == "charge"]
    assert len(charges) == 1 and charges[0]["delta"] == pytest.approx(job["plan"]["delta"])
    # An (ε, δ) charge composes basically: the dataset's spent ε is the job's ε.
    assert budget["spent"] == pytest.approx(job["plan"]["epsilon"], rel=1e-12)
    assert budget["reserved"] == 0


def test_cancelled_before_start_releases_everything(api, dataset, ana, spec, session):
    body = spec(dataset["id"], epsilon=2.0, accounting="ps", mean=3, eta=1)
    body["search_space"] = {"optimizer.lr": {"log_uniform": [0.01, 1]}}
    jid = api.client.post("/v1/jobs", headers=ana, json=body).json()["id"]
    api.client.post(f"/v1/jobs/{jid}/cancel", headers=ana)
    budget = api.budget(dataset["id"])
    assert [e["kind"] for e in budget["entries"]] == ["reservation", "release"]
    assert budget["spent"] == 0 and budget["reserved"] == 0 and budget["remaining"] == 4.0
    with pytest.raises(AttemptRefused, match="cancelled"):
        start_attempt(session, jid, 0, {"optimizer.lr": 0.1})


def test_ledger_rows_are_append_only(api, dataset, ana, spec, session):
    api.client.post("/v1/jobs", headers=ana, json=spec(dataset["id"]))
    row = session.execute(select(LedgerEntry)).scalar_one()
    row.epsilon = 0.0
    with pytest.raises(RuntimeError, match="append-only"):
        session.commit()
    session.rollback()
    session.delete(row)
    with pytest.raises(RuntimeError, match="append-only"):
        session.commit()


def _metrics(value: float) -> list[dict]:
    return [
        {"name": "train_loss", "value": value, "epoch": 1, "public": False},
        {"name": "val_accuracy", "value": value, "epoch": 1, "public": True},
    ]


@pytest.mark.parametrize("accounting", ["rdp", "ps"])
def test_trials_and_model_visibility(api, dataset, ana, spec, session, settings, accounting):
    body = spec(dataset["id"], epsilon=2.0)
    if accounting == "ps":
        body = spec(dataset["id"], epsilon=2.0, accounting="ps", mean=3, eta=1)
        body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    jid = api.client.post("/v1/jobs", headers=ana, json=body).json()["id"]
    for index, lr in enumerate((0.05, 0.2)):
        attempt = start_attempt(session, jid, index, {"optimizer.lr": lr})
        record_progress(session, attempt, 23, _metrics(0.5 + index))
        finish_attempt(session, attempt, "succeeded", 23, 0.8 + index)
    c = api.client
    assert c.get(f"/v1/jobs/{jid}/model", headers=ana).status_code == 409
    before = c.get(f"/v1/jobs/{jid}/trials", headers=ana).json()
    assert len(before) == (2 if accounting == "rdp" else 0)

    trial = session.get(Job, jid).trials[1]
    weights = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    release_model(
        session,
        settings.data_path,
        trial.id,
        weights,
        {"model": {"name": "mlp"}},
        {"num_classes": 10, "input_shape": [64]},
    )
    lifecycle.apply_state(session, jid, JobState.SUCCEEDED)

    seen = c.get(f"/v1/jobs/{jid}/trials", headers=ana).json()
    assert all(m["public"] for t in seen for m in t["metrics"])
    assert all(t["status"] is None and t["attempts"] is None for t in seen)
    if accounting == "rdp":
        assert [t["index"] for t in seen] == [0, 1]
    else:  # only the released trial, and nothing that reveals how many ran
        assert seen == [
            {
                "index": None,
                "params": {"optimizer.lr": 0.2},
                "score": 1.8,
                "metrics": _metrics(1.5)[1:],
                "thresholds": None,
                "released": True,
                "status": None,
                "steps": None,
                "attempts": None,
                "epsilon": None,
                "score_std": session.get(Job, jid).plan["score_std"],  # the plan's, whatever K
            }
        ]
    full = c.get(f"/v1/jobs/{jid}/trials", headers=api.operator).json()
    assert len(full) == 2 and len(full[0]["metrics"]) == 2 and full[0]["attempts"]

    r = c.get(f"/v1/jobs/{jid}/model", headers=ana)
    assert r.status_code == 200
    np.testing.assert_array_equal(load(r.content)["fc.weight"], weights["fc.weight"])
    assert c.get(f"/v1/jobs/{jid}", headers=ana).json()["released"]


class ReportsFailed:
    """An orchestrator that, after a restart, reports every job failed."""

    dashboard_url = None

    def submit(self, submission) -> None: ...
    def status(self, job_id: int) -> JobState:
        return JobState.FAILED

    def cancel(self, job_id: int) -> None: ...
    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return dict.fromkeys(job_ids, JobState.FAILED)


def test_restart_reconciles_and_settles(settings, spec):
    with TestClient(create_app(settings)) as c:
        op = {"Authorization": f"Bearer {settings.operator_key.get_secret_value()}"}
        ds = c.post(
            "/v1/datasets",
            headers=op,
            json={"name": "d", "source": "builtin:digits", "epsilon": 4, "delta": 1e-5},
        ).json()["id"]
        jid = c.post("/v1/jobs", headers=op, json=spec(ds, epsilon=2.0)).json()["id"]
        with c.app.state.sessions() as session:
            start_attempt(session, jid, 0, {"optimizer.lr": 0.05})
    with TestClient(create_app(settings, orchestrator=ReportsFailed())) as c:
        assert c.get(f"/v1/jobs/{jid}", headers=op).json()["status"] == "failed"
        entries = c.get(f"/v1/datasets/{ds}/budget", headers=op).json()["entries"]
        assert [e["kind"] for e in entries] == ["reservation", "charge", "release"]
