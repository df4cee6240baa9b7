"""Tuning on a public proxy: the search runs on a dataset the operator registered as public
(free), and only its chosen candidate trains on the private dataset — charged as one trial
whatever shape the search picks, and never more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from core.accounting import ORDERS
from core.plan import proxy_batch_size
from core.sampling import num_steps
from core.shapes import plan_shapes, shape_curve
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


def test_a_proxy_search_costs_one_private_trial_of_any_shape(runs, filter_epsilon):
    api, orchestrator = runs
    private = api.register("digits", epsilon=8.0)["id"]
    public = api.register("digits-public", public=True)
    assert public["public"] is True
    r = api.client.post("/v1/jobs", headers=api.operator, json=_proxy_spec(private, public["id"]))
    assert r.status_code == 202, r.text
    job = r.json()
    plan = job["plan"]
    assert plan["proxy"] == {"dataset": public["id"], "trials": 6, "size": public["n"]}
    assert plan["trials"]["max"] == 1
    assert plan["method"] == {"kind": "rdp", "trials": 1, "pld_delta": None}  # shapes: RDP alone
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
    assert _one_trial_epsilon(shape, 1e-5) <= plan["epsilon"]
    # the job counts as its curve through the dataset's filter: the shape that ran, alone
    curve = shape_curve(shape, 20.0)
    assert budget["spent"] == pytest.approx(filter_epsilon(8.0, 1e-5, curve), rel=1e-9)
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


def _npz(path: Path, n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    np.savez(path, x=x, y=rng.integers(0, 3, size=n))


def test_a_proxy_smaller_than_a_batch_is_searched_at_its_own_size(runs, settings):
    """A proxy of 60 examples searches shapes of batch 128 (refused before): the plan records
    its size, and each shape runs there at its own q and T."""
    api, _ = runs
    _npz(settings.data_path / "private.npz", 400)
    _npz(settings.data_path / "small.npz", 60)
    private = api.register("private", source="npz:private.npz", num_classes=3)["id"]
    public = api.register("small", source="npz:small.npz", num_classes=3, public=True)["id"]
    body = _proxy_spec(private, public)
    body["validation"] = {"split": "private", "fraction": 0.2, "noise": 20.0}
    r = api.client.post("/v1/plans", headers=api.operator, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["proxy"] == {"dataset": public, "trials": 6, "size": 60}
    for shape in plan_shapes(plan):
        batch = proxy_batch_size(shape.sample_rate, 60)
        assert 1 <= batch <= 60
        assert num_steps(60, batch, shape.epochs) == pytest.approx(shape.steps, rel=0.1)


@given(
    rate=st.floats(1e-4, 1.0),
    size=st.integers(1, 10**6),
    epochs=st.floats(0.5, 50),
)
def test_a_proxy_batch_keeps_the_shapes_rate_and_steps(rate, size, epochs) -> None:
    """q·size rounded, at least one: the proxy's rate is within half an example of q, and its
    steps epochs·size/B within that of epochs/q (exactly the shape's T when q·size ≥ 1)."""
    batch = proxy_batch_size(rate, size)
    assert batch >= 1
    assert abs(batch - rate * size) <= 0.5 or batch == 1
    if rate * size >= 10:
        assert num_steps(size, batch, epochs) == pytest.approx(epochs / rate, rel=0.06, abs=1)
