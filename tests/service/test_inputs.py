"""Malformed and hostile inputs get a 4xx naming the field and change nothing."""

from __future__ import annotations

import copy
import json

import pytest


def _changed(api, ds: int) -> tuple:
    jobs = api.client.get("/v1/jobs", headers=api.operator).json()
    datasets = api.client.get("/v1/datasets", headers=api.operator).json()
    return len(jobs), len(datasets), len(api.budget(ds)["entries"])


def _field(response) -> str:
    return response.json()["detail"].split(":", 1)[0]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"epsilon": -1}, "epsilon"),
        ({"epsilon": 0}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 0}, "delta"),
        ({"source": "npz:../outside.npz"}, "source"),
        ({"source": "npz:/etc/passwd"}, "source"),
        ({"source": "npz:sub/../../outside.npz"}, "source"),
        ({"source": "builtin:imagenet"}, "source"),
        ({"name": "digits"}, "name"),  # already registered
        ({"owner": "me"}, "owner"),
        ({"options": {"bogus": 1}}, "options.bogus"),
        ({"options": {"x": [1, 2]}}, "options.x"),
    ],
)
def test_bad_dataset(api, dataset, change, field):
    body = {"name": "d2", "source": "builtin:digits", "epsilon": 1, "delta": 1e-5} | change
    before = _changed(api, dataset["id"])
    r = api.client.post("/v1/datasets", headers=api.operator, json=body)
    assert r.status_code in (409, 422), r.text
    assert _field(r) == field
    assert _changed(api, dataset["id"]) == before


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('"epsilon": NaN, "delta": 1e-5', "epsilon"),
        ('"epsilon": 1, "delta": Infinity', "delta"),
        ('"epsilon": 1, "delta": 1e-5, "options": {"scale": NaN}', "options.scale"),
    ],
)
def test_non_finite_numbers_in_raw_json(api, dataset, raw, field):
    body = '{"name": "d2", "source": "builtin:heavy_tail", ' + raw + "}"
    r = api.client.post(
        "/v1/datasets", headers=api.operator | {"content-type": "application/json"}, content=body
    )
    assert r.status_code == 422 and _field(r) == field


def _set(body: dict, path: str, value) -> dict:
    body = copy.deepcopy(body)
    *parents, last = path.split("/")
    node = body
    for p in parents:
        node = node[p]
    node[last] = value
    return body


HUGE_GRID = {
    f"{p}": {"grid": [0.1 * (i + 1) for i in range(20)]}
    for p in ("optimizer.lr", "method.threshold", "optimizer.weight_decay")
}


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("privacy/epsilon", -1, "privacy.epsilon"),
        ("privacy/epsilon", float("nan"), "privacy.epsilon"),
        ("privacy/epsilon", float("inf"), "privacy.epsilon"),
        ("privacy/epsilon", 1e-6, "privacy.epsilon"),  # no noise makes it this small
        ("privacy/delta", 1.5, "privacy.delta"),
        ("privacy/delta", 0.01, "privacy.delta"),  # more than the dataset's δ
        ("privacy/accounting", "magic", "privacy.accounting"),
        ("privacy/trials", 0, "privacy.trials"),
        ("privacy/gamma", 0.5, "privacy.gamma"),  # not an rdp parameter
        ("method/clipping", "magic", "method.clipping"),
        ("method/style", "groups", "method.groups"),
        ("model/name", "gpt", "model.name"),
        ("optimizer/lr", float("inf"), "optimizer.lr"),
        ("batch_size", 10**6, "batch_size"),  # larger than the dataset
        ("batch_size", -5, "batch_size"),
        ("search_space", HUGE_GRID, "search_space"),
        (
            "search_space",
            {"physical_batch_size": {"grid": [32, 64]}},
            "search_space.physical_batch_size",
        ),
        ("search_space", {"batch_size": {"grid": [32, 10_000]}}, "batch_size"),
        ("search_space", {"optimizer.lr": {"grid": [-1.0]}}, "search_space.optimizer.lr"),
        ("search_space", {"optimizer.lr": {"log_uniform": [1, 0.1]}}, "search_space.optimizer.lr"),
        ("search_space", {"optimizer.lr": {"values": [0.1]}}, "privacy.trials"),
        ("dataset", 999, "dataset"),
        ("validation", {"split": "private"}, "validation"),
        (
            "method/adaptive",
            {"rule": "dcsgd_p", "histogram_noise": 0.01},
            "method.adaptive.histogram_noise",
        ),
        ("resources", {"gpu": 100}, "resources.gpu"),
        ("surprise", 1, "surprise"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/plans", "/v1/jobs"])
def test_bad_job_spec(api, dataset, ana, spec, endpoint, path, value, field):
    body = _set(spec(dataset["id"]), path, value)
    before = _changed(api, dataset["id"])
    r = api.client.post(
        endpoint, headers=ana | {"content-type": "application/json"}, content=json.dumps(body)
    )  # json.dumps writes NaN and Infinity
    assert 400 <= r.status_code < 500, r.text
    if field == "dataset":
        assert r.status_code == 404
    else:
        assert _field(r).startswith(field), r.text
    assert _changed(api, dataset["id"]) == before


def test_grid_under_random_stopping_is_refused(api, dataset, ana, spec):
    body = spec(dataset["id"], accounting="ps", mean=3, eta=1)
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 422 and _field(r) == "search_space.optimizer.lr"
    assert "invariant 6" in r.text


def test_oversized_body(api, dataset, ana, spec):
    before = _changed(api, dataset["id"])
    body = spec(dataset["id"])
    body["model"]["options"] = {f"k{i}": "x" * 100 for i in range(1000)}
    r = api.client.post("/v1/jobs", headers=ana, json=body)
    assert r.status_code == 413 and _field(r) == "body"

    def chunks():  # no Content-Length: counted as it streams
        yield b'{"name": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    r = api.client.post("/v1/datasets", headers=api.operator, content=chunks())
    assert r.status_code == 413
    assert _changed(api, dataset["id"]) == before


def test_bad_idempotency_key(api, dataset, ana, spec):
    r = api.client.post(
        "/v1/jobs", headers=ana | {"Idempotency-Key": "k" * 201}, json=spec(dataset["id"])
    )
    assert r.status_code == 422 and _field(r) == "idempotency-key"
