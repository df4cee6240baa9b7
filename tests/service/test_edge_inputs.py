"""Edge inputs that once answered 500 (issue 42): extreme numbers, deep nesting, strings that
are not UTF-8 text (a lone surrogate) or that a database refuses (NUL), a race on an
``Idempotency-Key``, built-in model options nobody reads, and what a runner may store. Each
gets a 4xx naming the field with nothing reserved, and no view is poisoned by what is stored.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import update

from core import accounting
from core.spec import JobSpec
from service import lifecycle
from service.db import Trial
from service.orchestration import NullOrchestrator, Submission

SURROGATE, NUL = "\ud800", "\x00"


def _raw(api, method: str, path: str, headers: dict[str, str], body: Any):
    """A request whose JSON may hold lone surrogates (``json.dumps`` escapes them)."""
    return api.client.request(
        method,
        path,
        headers=headers | {"content-type": "application/json"},
        content=json.dumps(body),
    )


def _ledger(api, dataset: int) -> list[Any]:
    return api.budget(dataset)["entries"]


def _jobs(api) -> int:
    return len(api.client.get("/v1/jobs", headers=api.operator).json())


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _refused(api, response, field: str | None = None) -> None:
    """A 4xx whose body is JSON that names ``field`` (when given)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    if field is not None:
        assert body["detail"].split(":", 1)[0].startswith(field), body


LT = {"epsilon": 2.0, "accounting": "lt"}
NUMERIC_EDGES = [
    ("privacy", LT | {"gamma": 5e-324}, "privacy.gamma"),
    ("privacy", LT | {"gamma": 0.5, "delta2": 5e-324}, "privacy.delta2"),
    ("privacy", LT | {"gamma": 0.5, "delta": 5e-324}, "privacy.delta"),
    ("privacy", {"epsilon": 1.0, "accounting": "rdp", "delta": 5e-324}, "privacy.delta"),
    ("validation", {"split": "private", "noise": 1e300}, "validation.noise"),
    ("validation", {"split": "private", "noise": 20.0, "fraction": 5e-324}, "validation.fraction"),
]


def test_numeric_edge_values_are_refused_naming_the_field(api, dataset, ana, spec):
    before = _ledger(api, dataset["id"])
    for part, value, field in NUMERIC_EDGES:
        body = spec(dataset["id"]) | {part: value}
        if value.get("accounting") in ("lt", "ps"):
            body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
        for endpoint in ("/v1/plans", "/v1/jobs"):
            r = api.client.post(endpoint, headers=ana, json=body)
            assert r.status_code == 422, (endpoint, value, r.text)
            _refused(api, r, field)
    assert _ledger(api, dataset["id"]) == before


def test_a_spec_nested_deep_is_refused_not_a_recursion_error(api, dataset, ana, spec):
    before = _ledger(api, dataset["id"])
    body = spec(dataset["id"]) | {"model": {"name": "mlp", "options": _deep(950)}}
    r = _raw(api, "POST", "/v1/jobs", ana, body)
    _refused(api, r)
    assert _ledger(api, dataset["id"]) == before


@pytest.mark.parametrize("depth", [60, 950, 5000])
def test_the_spec_refuses_deep_nesting_by_any_route(spec, depth):
    """A stored or directly validated spec, not only a request body: a ValidationError."""
    for part in ("model", "search_space", "method"):
        body = spec(1) | {part: _deep(depth)}
        with pytest.raises(ValidationError):
            JobSpec.model_validate(body)


STRINGS = [SURROGATE, NUL, "a\ud800b", "\udfff", "x\x00"]
SPEC_STRINGS = [
    ("search_space", lambda s: {s: {"values": [0.1]}}, "search_space"),
    ("search_space", lambda s: {"optimizer.name": {"values": [s]}}, "search_space"),
    ("model", lambda s: {"name": "mlp", "options": {s: 1}}, "model.options"),
    ("model", lambda s: {"name": "pkg.m:f", "options": {"width": s}}, "model"),
    ("model", lambda s: {"name": s}, "model.name"),
    ("method", lambda s: {"style": "groups", "groups": [[s]]}, "method"),
]


def test_strings_that_are_not_text_are_refused_in_a_spec(api, dataset, ana, spec):
    """In a key or a value, at any depth: a 422 naming the part, its body readable JSON (the
    offending input escaped), nothing reserved."""
    before = _ledger(api, dataset["id"])
    for text in STRINGS:
        for part, make, field in SPEC_STRINGS:
            body = spec(dataset["id"]) | {part: make(text)}
            for endpoint in ("/v1/plans", "/v1/jobs"):
                r = _raw(api, "POST", endpoint, ana, body)
                assert r.status_code == 422, (endpoint, part, r.status_code, r.text[:300])
                _refused(api, r, field)
                r.content.decode("utf-8")
    assert _ledger(api, dataset["id"]) == before


def test_strings_that_are_not_text_are_refused_in_names(api, dataset):
    datasets = len(api.client.get("/v1/datasets", headers=api.operator).json())
    for text in STRINGS:
        _refused_in_names(api, dataset, text)
    assert len(api.client.get("/v1/datasets", headers=api.operator).json()) == datasets


def _refused_in_names(api, dataset, text: str) -> None:
    body = {"name": f"d{text}", "source": "builtin:digits", "epsilon": 1.0, "delta": 1e-5}
    _refused(api, _raw(api, "POST", "/v1/datasets", api.operator, body), "name")
    body = {"name": "d2", "source": "builtin:heavy_tail", "epsilon": 1, "delta": 1e-5}
    body["options"] = {f"scale{text}": 1.0}
    _refused(api, _raw(api, "POST", "/v1/datasets", api.operator, body), "options")
    body["options"] = {"scale": text}
    _refused(api, _raw(api, "POST", "/v1/datasets", api.operator, body), "options")
    key = {"name": f"k{text}", "role": "analyst", "datasets": [dataset["id"]]}
    _refused(api, _raw(api, "POST", "/v1/keys", api.operator, key), "name")


UNKNOWN_OPTIONS = [
    ("mlp", {"hiden": 64}, "model.options.hiden"),
    ("mlp", {"hidden": 0}, "model.options.hidden"),
    ("mlp", {"hidden": "64"}, "model.options.hidden"),
    ("mlp", {"layers": True}, "model.options.layers"),
    ("mlp", {"hidden": 2**40}, "model.options.hidden"),
    ("cnn", {"width": 8}, "model.options.width"),
    ("logreg", {"bias": 1}, "model.options.bias"),
    ("transformer", {"heads": 2.5}, "model.options.heads"),
]
PRIVACY = {
    "rdp": {"epsilon": 2.0, "accounting": "rdp"},
    "lt": {"epsilon": 2.0, "accounting": "lt", "gamma": 0.5},
    "ps": {"epsilon": 2.0, "accounting": "ps", "mean": 2, "eta": 1},
}


def test_unknown_builtin_model_options_are_refused_before_anything_is_reserved(
    api, dataset, ana, spec
):
    before = _ledger(api, dataset["id"])
    for (name, options, field), kind in itertools.product(UNKNOWN_OPTIONS, PRIVACY):
        body = spec(dataset["id"]) | {"privacy": PRIVACY[kind]}
        body |= {"model": {"name": name, "options": options}, "search_space": {}}
        r = api.client.post("/v1/jobs", headers=ana, json=body)
        assert r.status_code == 422, (name, options, r.text)
        assert r.json()["errors"][0]["field"] == field, r.text
    assert _ledger(api, dataset["id"]) == before
    body = spec(dataset["id"]) | {"model": {"name": "mlp", "options": {"hidden": 8}}}
    assert api.client.post("/v1/plans", headers=ana, json=body).status_code == 200


def test_the_same_idempotency_key_at_the_same_instant_is_one_job_and_a_409(
    api, dataset, spec, settings, monkeypatch
):
    """Two datasets lock two rows, so on PostgreSQL both requests may pass the check for an
    earlier job before either commits; the second insert then hit the unique constraint (a
    500). Forced here: after the request's check for an earlier job, the same key is admitted
    and committed for the other dataset, then the request goes on. (SQLite admits one writer
    at a time: no race, the requests run one after the other.)"""
    other = api.register(name="other")
    headers = api.analyst(dataset["id"], other["id"]) | {"Idempotency-Key": "same"}
    admit, amount = lifecycle.admit, lifecycle.ledger.amount

    def admit_racing(session, principal, job_spec, planned, key):
        def the_other_first(reservation):
            monkeypatch.setattr(lifecycle.ledger, "amount", amount)
            moved = job_spec.model_copy(update={"dataset": other["id"]})
            with api.client.app.state.sessions() as racer:
                admit(racer, principal, moved, dataclasses.replace(planned, spec=moved), key)
            return amount(reservation)

        monkeypatch.setattr(lifecycle, "admit", admit)
        monkeypatch.setattr(lifecycle.ledger, "amount", the_other_first)
        return admit(session, principal, job_spec, planned, key)

    if not settings.sqlalchemy_url.startswith("sqlite"):
        monkeypatch.setattr(lifecycle, "admit", admit_racing)
        r = api.client.post("/v1/jobs", headers=headers, json=spec(dataset["id"]))
    else:
        api.client.post("/v1/jobs", headers=headers, json=spec(other["id"]))
        r = api.client.post("/v1/jobs", headers=headers, json=spec(dataset["id"]))
    assert r.status_code == 409, r.text
    assert r.json()["errors"][0]["field"] == "Idempotency-Key"
    reservations = [
        e for d in (dataset, other) for e in _ledger(api, d["id"]) if e["kind"] == "reservation"
    ]
    assert len(reservations) == _jobs(api) == 1


def _runner(
    api, dataset: int, spec, owner: dict[str, str] | None = None
) -> tuple[str, dict[str, str], int]:
    tokens: dict[int, str] = {}

    class Recorder(NullOrchestrator):
        def submit(self, submission: Submission) -> None:
            tokens[submission.job_id] = submission.token

    api.client.app.state.orchestrator = Recorder()
    job = api.client.post("/v1/jobs", headers=owner or api.operator, json=spec(dataset)).json()
    runner = {"Authorization": f"Bearer {tokens[job['id']]}"}
    base = f"/internal/v1/jobs/{job['id']}"
    assert api.client.post(f"{base}/start", headers=runner).status_code == 204
    return base, runner, job["id"]


RUNNER_BODIES = [
    ("attempts", {"index": 0, "params": {SURROGATE: 0.1}}, "params"),
    ("attempts", {"index": 0, "params": {"optimizer.lr": SURROGATE}}, "params"),
    ("attempts", {"index": 0, "params": {"optimizer.name": "s\x00gd"}}, "params"),
    ("progress", {"steps": 1, "metrics": [{"name": "loss", "value": _deep(949)}]}, None),
    ("progress", {"steps": 1, "metrics": [{"name": "loss", "value": _deep(20)}]}, "metrics"),
    ("progress", {"steps": 1, "metrics": [{"name": SURROGATE, "value": 1}]}, "metrics"),
    ("progress", {"steps": 1, "metrics": [{"name": "l\x00ss", "value": 1}]}, "metrics"),
    ("progress", {"steps": 1, "metrics": [{"x" * 10: "y" * 100_000}]}, None),
]


def test_a_runner_cannot_store_what_no_view_can_render(api, dataset, spec):
    base, runner, job = _runner(api, dataset["id"], spec)
    made = api.client.post(f"{base}/attempts", headers=runner, json={"index": 0, "params": {}})
    paths = {
        "attempts": f"{base}/attempts",
        "progress": f"{base}/attempts/{made.json()['attempt']}/progress",
    }
    for call, body, field in RUNNER_BODIES:
        _refused(api, _raw(api, "POST", paths[call], runner, body), field)
    r = api.client.get(f"/v1/jobs/{job}/trials", headers=api.operator)
    assert r.status_code == 200, r.text
    assert [t["params"] for t in r.json()] == [{}] and r.json()[0]["metrics"] == []


def test_a_runner_error_that_is_not_text_still_ends_the_job(api, dataset, spec):
    for text in (NUL, SURROGATE):
        base, runner, job = _runner(api, dataset["id"], spec)
        error = {"state": "failed", "error": f"boom{text}!"}
        r = _raw(api, "POST", f"{base}/end", runner, error)
        assert r.status_code == 200, r.text
        shown = api.client.get(f"/v1/jobs/{job}", headers=api.operator)
        assert shown.status_code == 200 and shown.json()["status"] == "failed", shown.text
        assert "boom" in shown.text


POISON = [
    {"params": {SURROGATE: "\udfff"}},
    {"params": {"optimizer.lr": "fast"}, "score": 0.5, "status": "succeeded"},
    {"params": {"optimizer.lr": SURROGATE}, "score": 0.5},
    {"params": {"optimizer.name": "sgd"}, "score": 0.5},
    {"metrics": [{"name": "loss", "value": _deep(500)}]},
    {"metrics": [{"name": SURROGATE, "value": {"x": [SURROGATE] * 3}, "public": True}]},
    {"thresholds": [1.0, 2.0]},
]


def test_views_render_whatever_is_already_stored(api, dataset, spec):
    """Written past the API (an older service, a row edited by hand): every view answers."""
    ana = api.analyst(dataset["id"])
    base, runner, job = _runner(api, dataset["id"], spec, ana)
    api.client.post(f"{base}/attempts", headers=runner, json={"index": 0, "params": {}})
    for stored in POISON:
        with api.client.app.state.sessions() as session:
            session.execute(update(Trial).where(Trial.job_id == job).values(**stored))
            session.commit()
        for who, path in itertools.product(
            (api.operator, ana), (f"/v1/jobs/{job}/trials", f"/v1/jobs/{job}", "/v1/jobs")
        ):
            r = api.client.get(path, headers=who)
            assert r.status_code == 200, (stored, path, r.text[:300])
            json.loads(r.content.decode("utf-8"))
        r = api.client.get(f"/v1/jobs/{job}/report.png", headers=api.operator)
        assert r.status_code == 200, (stored, r.text[:300])


EXTREME_VALUES = [0, 0.0, -0.0, 5e-324, -5e-324, 1e-300, 1e300, -1e300, float("inf")]
EXTREME = st.sampled_from([*EXTREME_VALUES, float("nan"), 2**63, 2**31, -1, 1, 0.5, 10**30])
NUMERIC_PATHS = [
    "privacy/epsilon",
    "privacy/delta",
    "privacy/gamma",
    "privacy/expected_trials",
    "privacy/delta2",
    "privacy/mean",
    "privacy/eta",
    "privacy/max_trials",
    "privacy/trials",
    "privacy/max_retries",
    "validation/noise",
    "validation/fraction",
    "epochs",
    "batch_size",
    "physical_batch_size",
    "method/threshold",
    "method/gamma",
    "optimizer/lr",
    "optimizer/momentum",
    "optimizer/weight_decay",
    "optimizer/eps",
    "optimizer/gamma_prime",
    "resources/cpu",
    "resources/gpu",
    "seed",
]


def _put(body: dict, path: str, value: Any) -> dict:
    body = copy.deepcopy(body)
    *parents, last = path.split("/")
    node = body
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return body


def test_extreme_numbers_in_any_spec_field_never_answer_5xx(api, dataset, ana, spec):
    """Property: every numeric field of the spec, under each accounting, drawn from extreme
    values (several at once): never a 5xx, and a 4xx reserves nothing."""
    bases = {
        "rdp": spec(dataset["id"]),
        "lt": spec(dataset["id"]) | {"privacy": dict(PRIVACY["lt"]), "search_space": {}},
        "ps": spec(dataset["id"]) | {"privacy": dict(PRIVACY["ps"]), "search_space": {}},
    }

    @hypothesis_settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        accounting=st.sampled_from(sorted(bases)),
        changes=st.lists(
            st.tuples(st.sampled_from(NUMERIC_PATHS), EXTREME), min_size=1, max_size=3
        ),
        endpoint=st.sampled_from(["/v1/plans", "/v1/jobs"]),
    )
    def check(accounting: str, changes: list[tuple[str, Any]], endpoint: str) -> None:
        body = bases[accounting]
        for path, value in changes:
            body = _put(body, path, value)
        before = _ledger(api, dataset["id"])
        r = _raw(api, "POST", endpoint, ana | {"content-type": "application/json"}, body)
        assert r.status_code < 500, (changes, r.text[:300])
        if r.status_code >= 400:
            assert _ledger(api, dataset["id"]) == before, (changes, r.text[:300])

    check()


@pytest.mark.parametrize(("gamma", "delta2"), [(5e-324, 1e-6), (0.5, 5e-324), (1e-300, 1e-300)])
def test_a_liu_talwar_cap_that_overflows_is_refused_naming_gamma(gamma, delta2):
    """By any route, not only a spec: the method itself refuses a cap ⌈ln(1/δ₂)/γ⌉ that is no
    integer, rather than overflowing when a caller asks for it."""
    with pytest.raises(ValueError, match=r"^gamma: the cap on trials"):
        accounting.tuning_method("lt", gamma=gamma, delta2=delta2)
