"""Tuning on a public proxy: the search runs on a dataset the operator registered as public
(free), and only its chosen candidate trains on the private dataset — charged as one trial
whatever shape the search picks, and never more."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient

from core.accounting import ORDERS
from core.shapes import plan_shapes
from service.api import create_app

from .conftest import OPERATOR_KEY, Api, bearer, make_spec
from .test_runner_api import RecordingOrchestrator


@pytest.fixture
def runs(settings) -> Iterator[tuple[Api, RecordingOrchestrator]]:
    orchestrator = RecordingOrchestrator()
    with TestClient(create_app(settings, orchestrator)) as client:
        yield Api(client, bearer(OPERATOR_KEY)), orchestrator


def _one_trial_epsilon(shape: Any, delta: float) -> float:
    """One trial of ``shape`` (with the spec's private validation score, noise 20), composed
    by dp-accounting's own accountant."""
    step = dp_event.PoissonSampledDpEvent(
        shape.sample_rate, dp_event.GaussianDpEvent(shape.noise_multiplier)
    )
    accountant = rdp_lib.RdpAccountant(orders=list(ORDERS))
    accountant.compose(dp_event.SelfComposedDpEvent(step, shape.steps))
    accountant.compose(dp_event.GaussianDpEvent(20.0))
    return accountant.get_epsilon(delta)


def _proxy_spec(dataset: int, proxy: int) -> dict[str, Any]:
    body = make_spec(dataset, 2.0)
    body["proxy"] = proxy
    body["search_space"] = {
        "optimizer.lr": {"grid": [0.05, 0.2, 0.5]},
        "batch_size": {"grid": [32, 128]},
    }
    return body


def test_a_proxy_search_costs_one_private_trial_of_any_shape(runs):
    api, orchestrator = runs
    private = api.register("digits", epsilon=8.0)["id"]
    public = api.register("digits-public", public=True)
    assert public["public"] is True
    r = api.client.post("/v1/jobs", headers=api.operator, json=_proxy_spec(private, public["id"]))
    assert r.status_code == 202, r.text
    job = r.json()
    plan = job["plan"]
    assert plan["proxy"] == {"dataset": public["id"], "trials": 6}
    assert plan["trials"]["max"] == 1 and plan["method"] == {"kind": "rdp", "trials": 1}
    assert 2.0 * 0.99 <= plan["epsilon"] <= 2.0
    # the private run may be either shape: each alone costs at most the job's ε
    for shape in plan_shapes(plan):
        assert _one_trial_epsilon(shape, plan["delta"]) <= plan["epsilon"] + 1e-12
    assert orchestrator.submitted[job["id"]].job_id == job["id"]

    auth = bearer(orchestrator.submitted[job["id"]].token)
    context = api.client.get(f"/internal/v1/jobs/{job['id']}", headers=auth).json()
    assert context["proxy"]["source"] == "builtin:digits"
    base = f"/internal/v1/jobs/{job['id']}/attempts"
    # the one private trial: whichever shape the proxy chose, never a second trial
    chosen = {"index": 0, "params": {"optimizer.lr": 0.2, "batch_size": 128}}
    assert api.client.post(base, headers=auth, json=chosen).status_code == 201
    second = {"index": 1, "params": {"optimizer.lr": 0.05, "batch_size": 32}}
    refused = api.client.post(base, headers=auth, json=second)
    assert refused.status_code == 409 and "outside the plan's 1 trials" in refused.text
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.operator)
    budget = api.budget(private)
    [shape] = [s for s in plan_shapes(plan) if s.batch_size == 128]
    assert budget["spent"] == pytest.approx(_one_trial_epsilon(shape, 1e-5), rel=1e-9)
    assert api.budget(public["id"])["spent"] == 0.0


def test_proxies_are_public_shaped_alike_and_in_scope(runs):
    api, _ = runs
    private = api.register("digits", epsilon=8.0)["id"]
    other = api.register("other")["id"]
    public = api.register("digits-public", public=True)["id"]
    mnist1d = api.register("mnist1d-public", source="builtin:mnist1d", public=True)["id"]

    def post(body: dict[str, Any], headers: dict[str, str] = api.operator) -> Any:
        return api.client.post("/v1/plans", headers=headers, json=body)

    r = post(_proxy_spec(private, other))
    assert r.status_code == 422 and "is not registered as public" in r.text
    r = post(_proxy_spec(private, mnist1d))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "proxy"
    r = post(make_spec(public))
    assert r.status_code == 422 and "is public" in r.text
    body = _proxy_spec(private, public)
    body["privacy"] = {"epsilon": 2.0, "accounting": "ps", "mean": 3, "eta": 1}
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    r = post(body)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "proxy"
    analyst = api.analyst(private)  # the proxy is not in its scope
    assert post(_proxy_spec(private, public), analyst).status_code == 404
