"""The whole life of keys, datasets, budgets, plans, admission and refusal, over HTTP."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from core.sampling import num_steps


def opacus_epsilon(
    q: float, sigma: float, steps: int, delta: float, validation: float, trials: int
) -> float:
    """Independent check: Opacus's RDP analysis (signed series, its own order grid) of K
    trials, each T DP-SGD steps plus one Gaussian release with noise ``validation``."""
    orders = np.array([1 + x / 10 for x in range(1, 100)] + list(range(12, 64)))
    per_trial = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders) + orders / (
        2 * validation**2
    )
    return get_privacy_spent(orders=orders, rdp=trials * per_trial, delta=delta)[0]


def test_health_and_auth(client, api):
    assert client.get("/healthz").json() == {
        "status": "ok",
        "database": "ok",
        "ray": {"reachable": None, "error": None},  # this app polls no orchestrator
    }
    assert client.get("/v1/datasets").status_code == 401
    r = client.get("/v1/datasets", headers={"Authorization": "Bearer not-a-key"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/datasets", headers=api.operator).json() == []
    paths = client.get("/openapi.json").json()["paths"]
    assert {
        "/v1/keys",
        "/v1/datasets/{dataset_id}/budget",
        "/v1/plans",
        "/v1/jobs/{job_id}/model",
    } <= set(paths)


def test_lifecycle(client, api, dataset, ana, spec):
    n = dataset["n"]
    assert n > 1000 and dataset["num_classes"] == 10 and dataset["source"] == "builtin:digits"
    ds = dataset["id"]

    assert [d["id"] for d in client.get("/v1/datasets", headers=ana).json()] == [ds]
    budget = client.get(f"/v1/datasets/{ds}/budget", headers=ana).json()
    assert budget | {"entries": []} == {
        "epsilon": 4.0,
        "delta": 1e-5,
        "spent": 0.0,
        "reserved": 0.0,
        "remaining": 4.0,
        "entries": [],
        "entries_total": 0,
    }

    # A plan reserves nothing.
    plan = client.post("/v1/plans", headers=ana, json=spec(ds, epsilon=3.0)).json()
    assert plan["sample_rate"] == pytest.approx(64 / n)
    assert plan["steps"] == num_steps(n, 64, 1)  # the engine's own step count
    assert plan["trials"] == {"distribution": "fixed", "mean": 2, "max": 2, "eta": None}
    assert 3.0 * (1 - 1e-3) <= plan["epsilon"] <= 3.0
    assert plan["delta"] == 1e-5 and plan["validation_noise"] == 20.0 and plan["fits"]
    independent = opacus_epsilon(
        plan["sample_rate"], plan["noise_multiplier"], plan["steps"], 1e-5, 20.0, trials=2
    )
    if plan["bound"] == "rdp":
        assert plan["epsilon"] == pytest.approx(independent, rel=0.03)
    else:  # stated by the PLD of its composition, where that is below RDP (issue 41)
        assert plan["bound"] == "pld" and plan["epsilon"] < independent
    assert plan["remaining_epsilon"] == 4.0
    # the dataset counts the job through its filter (core.accounting.filter): its curve at the
    # dataset's order, and the conversion the first curve pays
    counted = 4.0 - plan["remaining_epsilon_after"]
    assert plan["epsilon"] < counted < 4.0
    assert api.budget(ds)["entries"] == []

    # Admission reserves the plan's full cost.
    r = client.post("/v1/jobs", headers=ana, json=spec(ds, epsilon=3.0))
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["plan"]["noise_multiplier"] == plan["noise_multiplier"]
    budget = api.budget(ds)
    assert budget["spent"] == 0.0
    assert budget["reserved"] == pytest.approx(counted, rel=1e-9)
    assert [(e["kind"], e["job"]) for e in budget["entries"]] == [("reservation", job["id"])]

    # A second job that does not fit is refused, saying by how much; nothing is reserved.
    assert not client.post("/v1/plans", headers=ana, json=spec(ds, epsilon=3.5)).json()["fits"]
    r = client.post("/v1/jobs", headers=ana, json=spec(ds, epsilon=3.5))
    assert r.status_code == 409
    assert r.json()["detail"].startswith("privacy.epsilon: ") and "over its budget" in r.text
    over = float(r.json()["detail"].rsplit("by ", 1)[1])
    assert over > 0
    assert len(api.budget(ds)["entries"]) == 1

    # A job that fits the composed remainder is admitted.
    r = client.post("/v1/jobs", headers=ana, json=spec(ds, epsilon=0.5))
    assert r.status_code == 202, r.text
    assert api.budget(ds)["remaining"] >= 0

    listed = client.get("/v1/jobs", headers=ana).json()
    assert [j["id"] for j in listed] == [r.json()["id"], job["id"]]
    assert client.get(f"/v1/jobs/{job['id']}/trials", headers=ana).json() == []
    r = client.get(f"/v1/jobs/{job['id']}/model", headers=ana)
    assert r.status_code == 409 and "no released model" in r.text

    # Cancelling a job that never started releases its whole reservation.
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ana)
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    budget = api.budget(ds)
    kinds = [(e["kind"], e["job"]) for e in budget["entries"]]
    assert ("release", job["id"]) in kinds and ("charge", job["id"]) not in kinds
    assert budget["spent"] == 0.0
    second_alone = client.get(f"/v1/jobs/{listed[0]['id']}", headers=ana).json()["plan"]
    assert second_alone["epsilon"] < budget["reserved"] < 4.0


@pytest.mark.parametrize(
    "privacy",
    [
        {"accounting": "lt", "expected_trials": 4},
        {"accounting": "ps", "mean": 4, "eta": 1},
        {"accounting": "ps", "mean": 3, "eta": "poisson", "max_trials": 30},
    ],
)
def test_random_stopping_plans(client, dataset, ana, spec, privacy):
    body = spec(dataset["id"], epsilon=2.0, **privacy)
    body["search_space"] = {"optimizer.lr": {"log_uniform": [0.01, 1.0]}}
    r = client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert 2.0 * (1 - 1e-3) <= plan["epsilon"] <= 2.0
    assert plan["trials"]["max"] >= plan["trials"]["mean"]
    if privacy["accounting"] == "lt":
        gamma = 1 / 4
        assert plan["trials"]["max"] == math.ceil(math.log(1 / plan["method"]["delta2"]) / gamma)


def test_dcsgd_plan_reports_gradient_noise(client, dataset, ana, spec):
    body = spec(dataset["id"], epsilon=2.0)
    body["method"]["adaptive"] = {"rule": "dcsgd_p", "histogram_noise": 5.0}
    plan = client.post("/v1/plans", headers=ana, json=body).json()
    sigma, sigma_t = plan["noise_multiplier"], plan["gradient_noise_multiplier"]
    assert sigma_t**-2 + 5.0**-2 == pytest.approx(sigma**-2)  # paper 001, Theorem 2


def test_npz_dataset_under_data_dir(api, settings):
    rng = np.random.default_rng(0)
    np.savez(
        settings.data_path / "mine.npz",
        x=rng.normal(size=(300, 5)).astype(np.float32),
        y=rng.integers(0, 3, size=300),
    )
    dataset = api.register("mine", source="npz:mine.npz", num_classes=3)
    assert (dataset["n"], dataset["num_classes"], dataset["input_shape"]) == (300, 3, [5])
    assert not dataset["public_validation"]
    r = api.client.post(
        "/v1/datasets",
        headers=api.operator,
        json={"name": "gone", "source": "npz:missing.npz", "epsilon": 1, "delta": 1e-5},
    )
    assert r.status_code == 422 and r.json()["detail"].startswith("source:")


def test_lt_refused_when_dataset_delta_is_used_up(client, api, dataset, ana, spec):
    assert client.post("/v1/jobs", headers=ana, json=spec(dataset["id"])).status_code == 202
    body = spec(dataset["id"], epsilon=2.0, accounting="lt", gamma=0.3)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    body["privacy"]["delta"] = 2e-6  # more than (ε, δ) statements may hold: 1e-6
    r = client.post("/v1/jobs", headers=ana, json=body)
    assert r.status_code == 409 and r.json()["detail"].startswith("privacy.delta:")
    body["privacy"]["delta"] = 2e-7
    assert client.post("/v1/jobs", headers=ana, json=body).status_code == 202


def test_operator_key_is_created_once(tmp_path, capsys):
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.settings import Settings

    settings = Settings(data_dir=tmp_path)
    with TestClient(create_app(settings)):
        pass
    secret = capsys.readouterr().out.split("(shown once): ")[1].strip()
    with TestClient(create_app(settings)) as c:
        r = c.get("/v1/keys", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200 and r.json()[0]["role"] == "operator"
        assert "secret" not in r.json()[0]
    assert "shown once" not in capsys.readouterr().out
