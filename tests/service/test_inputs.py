"""Malformed and hostile inputs get a 4xx naming the field and change nothing."""

from __future__ import annotations

import copy
import json

import pytest

from core.config import NOISE


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


#: (path, value, field): numbers of the wrong type or outside their range (docs/design.md,
#: invariant 12; issue 39, findings 1 and 12). Each is refused with a 422 naming the field.
INSANE = [
    # strings and bools are never read as numbers
    *[
        (path, value, path.replace("/", "."))
        for path in (
            "batch_size",
            "epochs",
            "physical_batch_size",
            "seed",
            "method/threshold",
            "method/gamma",
            "optimizer/lr",
            "optimizer/eps",
            "optimizer/momentum",
            "optimizer/weight_decay",
            "validation/noise",
            "privacy/epsilon",
            "privacy/trials",
        )
        for value in ("64", "1", "1e-3", True, False)
    ],
    ("optimizer/betas", [True, 0.9], "optimizer.betas"),
    ("optimizer/betas", ["0.9", 0.99], "optimizer.betas"),
    ("dataset", "1", "dataset"),
    ("resources", {"cpu": True}, "resources.cpu"),
    # a searched value of the wrong type (the first a 500 before: planned with the string)
    ("search_space", {"batch_size": {"grid": ["64", 32]}}, "search_space.batch_size"),
    ("search_space", {"batch_size": {"grid": [True, 32]}}, "search_space.batch_size"),
    ("search_space", {"epochs": {"grid": ["1", 2]}}, "search_space.epochs"),
    ("search_space", {"optimizer.lr": {"grid": ["0.1"]}}, "search_space.optimizer.lr"),
    ("search_space", {"method.threshold": {"grid": [True]}}, "search_space.method.threshold"),
    ("search_space", {"optimizer.lr": {"log_uniform": ["0.1", 1]}}, "search_space.optimizer"),
    # out of range: the planted-record attack's threshold, and what float32 cannot hold
    ("method/threshold", 64 * 1.15e-45, "method.threshold"),
    ("method/threshold", 1e-5, "method.threshold"),
    ("method/threshold", 1e5, "method.threshold"),
    ("method/gamma", 1e-45, "method.gamma"),
    ("method/gamma", 1e39, "method.gamma"),
    ("optimizer/lr", 1e39, "optimizer.lr"),
    ("optimizer/lr", 1e-45, "optimizer.lr"),
    ("optimizer/eps", 1e-45, "optimizer.eps"),
    ("optimizer/eps", 2.0, "optimizer.eps"),
    ("optimizer/gamma_prime", 1e-45, "optimizer.gamma_prime"),
    ("optimizer/momentum", 1.0, "optimizer.momentum"),
    ("optimizer/weight_decay", 1e39, "optimizer.weight_decay"),
    ("optimizer/betas", [1.0, 0.9], "optimizer.betas"),
    ("optimizer/betas", [0.9, -0.5], "optimizer.betas"),
    ("optimizer/betas", [0.9, 1e39], "optimizer.betas"),
    ("validation/noise", 1e300, "validation.noise"),
    ("validation/noise", 1e-45, "validation.noise"),
    ("search_space", {"optimizer.lr": {"grid": [0.1, 1e39]}}, "search_space.optimizer.lr"),
    ("search_space", {"method.threshold": {"log_uniform": [1e-45, 1]}}, "search_space.method"),
    *[
        ("method/adaptive", {"rule": rule, field: value}, f"method.adaptive.{field}")
        for rule, field, value in [
            ("dcsgd_p", "histogram_noise", 1e300),
            ("dcsgd_p", "histogram_noise", "5"),
            ("dcsgd_e", "initial_range", 1e-45),
            ("dcsgd_e", "bins", 10**9),
            ("dcsgd_e", "bins", True),
            ("andrew", "count_noise", 1e-9),
            ("andrew", "learning_rate", 1e3),
        ]
    ],
]


@pytest.mark.parametrize("endpoint", ["/v1/plans", "/v1/jobs"])
def test_insane_numbers_are_refused_naming_the_field(api, dataset, ana, spec, endpoint):
    """Every variant in one test (each is a request refused before planning): a 422 whose
    detail names the field, and nothing reserved or recorded."""
    before = _changed(api, dataset["id"])
    for path, value, field in INSANE:
        body = _set(spec(dataset["id"]), path, value)
        r = api.client.post(endpoint, headers=ana, json=body)
        assert r.status_code == 422, (path, value, r.text)
        assert _field(r).startswith(field), (path, value, r.text)
    assert _changed(api, dataset["id"]) == before


def test_a_planner_default_out_of_range_is_refused_naming_the_field(api, dataset, ana, spec):
    """SGD's default rate 0.5/C is 5000 at C = 1e-4, beyond ``optimizer.lr``'s range: refused
    at planning, rather than admitted for every trial to refuse."""
    body = spec(dataset["id"]) | {"search_space": {}, "optimizer": {"name": "sgd"}}
    body["method"]["threshold"] = 1e-4
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 422 and _field(r) == "optimizer.lr", r.text
    body["optimizer"]["lr"] = 100.0
    assert api.client.post("/v1/plans", headers=ana, json=body).status_code == 200


@pytest.mark.parametrize("search", [{}, {"batch_size": {"grid": [16, 512]}}])
def test_the_loosest_target_plans_noise_the_engine_admits(api, dataset, ana, spec, search):
    """ε = 100, the largest the spec admits, with a large batch: every planned σ is at least
    the engine's floor (``core.config.NOISE``), so no trial refuses its configuration."""
    body = spec(dataset["id"], epsilon=100.0) | {"search_space": search, "epochs": 0.05}
    body["batch_size"] = 1024
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    sigmas = [s["noise_multiplier"] for s in r.json()["shapes"]]
    assert min(sigmas) >= NOISE[0] and r.json()["epsilon"] <= 100.0
