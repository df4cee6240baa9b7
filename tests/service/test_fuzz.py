"""Fuzzing the API from its own OpenAPI schema (schemathesis on Hypothesis), over real HTTP.

Every operation is called with requests generated from the schema — valid ones and invalid
ones — as the operator, an analyst, an analyst of another dataset, with a bad key, and (for the
internal runner API) with a job's own runner token and another job's; path ids are sometimes
real ones, so the calls reach the handlers and not only the 404s. Each response must be no
5xx, have a status code, content type and body the schema declares, and — the privacy
property — a request answered 4xx must leave the ledger, the jobs and their attempts exactly
as they were (nothing spent by a refusal; docs/design.md, invariant 2).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine, select

from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.db import Job, LedgerEntry, TrialAttempt, create_db_engine
from service.orchestration import NullOrchestrator, Submission

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 10  # per operation and generation mode
#: operations that plan, calibrate, load data or draw a figure (up to a second or two each)
SLOW = {
    "POST /v1/jobs",
    "POST /v1/plans",
    "POST /v1/datasets",
    "PUT /v1/datasets/{dataset_id}/data",
    "GET /v1/jobs/{job_id}/report.png",
}
SLOW_EXAMPLES = 4
#: uvicorn's own answer to a request that is not valid HTTP (the negative mode can generate a
#: header such as ``content-length: H J``): the application never sees it, so its schema does
#: not describe it, and the state check alone applies
NOT_HTTP = (400, b"Invalid HTTP request received.")


@dataclass
class Recorder(NullOrchestrator):
    """Runs nothing, like the default, and keeps each job's runner token."""

    tokens: dict[int, str] = field(default_factory=dict)

    def submit(self, submission: Submission) -> None:
        self.tokens[submission.job_id] = submission.token


@dataclass
class World:
    url: str
    engine: Engine
    auth: dict[str, dict[str, str]]  # who -> headers
    internal_auth: dict[str, dict[str, str]]
    ids: dict[str, list[int]]  # path parameter -> real values


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def world(settings, spec) -> Iterator[World]:
    """Two datasets, an analyst on each, three jobs (one running, with an attempt)."""
    recorder = Recorder()
    operator = _bearer(settings.operator_key.get_secret_value())
    with BackgroundServer(create_app(settings, recorder), free_port()) as server:
        http = httpx.Client(base_url=server.url, timeout=120)

        def post(path: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
            r = http.post(path, headers=headers, json=body)
            assert r.status_code in (201, 202), r.text
            return r.json()

        datasets = [
            post(
                "/v1/datasets",
                operator,
                {"name": name, "source": "builtin:digits", "epsilon": 30.0, "delta": 1e-5},
            )["id"]
            for name in ("fuzz-a", "fuzz-b")
        ]
        analysts = [
            _bearer(post("/v1/keys", operator, {"role": "analyst", "datasets": [d]})["secret"])
            for d in datasets
        ]
        jobs = [
            post("/v1/jobs", analysts[0], spec(datasets[0]))["id"],
            post("/v1/jobs", analysts[0], spec(datasets[0]))["id"],
            post("/v1/jobs", operator, spec(datasets[1]))["id"],
        ]
        runner = _bearer(recorder.tokens[jobs[0]])
        assert http.post(f"/internal/v1/jobs/{jobs[0]}/start", headers=runner).status_code == 204
        attempt = post(f"/internal/v1/jobs/{jobs[0]}/attempts", runner, {"index": 0, "params": {}})[
            "attempt"
        ]
        http.close()
        yield World(
            url=server.url,
            engine=create_db_engine(settings.sqlalchemy_url),
            auth={
                "operator": operator,
                "analyst": analysts[0],
                "other analyst": analysts[1],
                "bad key": _bearer("dpt_not-a-key-0000000000000000"),
            },
            internal_auth={
                "own token": runner,
                "other job's token": _bearer(recorder.tokens[jobs[1]]),
                "operator key": operator,
            },
            ids={
                "dataset_id": datasets,
                "job_id": jobs,
                "attempt_id": [attempt],
                "index": [0, 1],
            },
        )


def state(engine: Engine) -> tuple[list[Any], ...]:
    """What a refused request must not change: every ledger row, every job's state, every
    trial attempt."""
    with engine.connect() as conn:
        return tuple(
            list(conn.execute(select(table).order_by(table.c.id)).all())
            for table in (LedgerEntry.__table__, Job.__table__, TrialAttempt.__table__)
        )


def _fuzz(world: World, operation: Any, mode: GenerationMode, examples: int) -> None:
    internal = operation.path.startswith("/internal/")
    auth = world.internal_auth if internal else world.auth
    known = {name: values for name, values in world.ids.items() if name in operation.path}

    @hypothesis_settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        case=operation.as_strategy(generation_mode=mode),
        who=st.sampled_from(sorted(auth)),
        real=st.fixed_dictionaries(
            {name: st.none() | st.sampled_from(values) for name, values in known.items()}
        ),
    )
    def check(case: Any, who: str, real: dict[str, int | None]) -> None:
        for name, value in real.items():
            if value is not None and isinstance(case.path_parameters, dict):
                case.path_parameters[name] = value
        before = state(world.engine)
        response = case.call(base_url=world.url, headers=auth[who])
        if (response.status_code, response.content.strip()) != NOT_HTTP:
            case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert state(world.engine) == before, (
                f"{operation.label} as {who} answered {response.status_code} "
                f"and changed the ledger: {response.text[:300]}"
            )

    check()


def _describe(error: BaseException) -> str:
    """The failure, each check that failed, and how to reproduce it (schemathesis's notes)."""
    parts = [str(error)]
    if isinstance(error, BaseExceptionGroup):
        parts += [f"- {type(e).__name__}: {e}" for e in error.exceptions]
    return "\n".join(parts + getattr(error, "__notes__", []))


def test_fuzz_every_operation(world: World) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(f"{world.url}/openapi.json").json())
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 15
    for operation in operations:
        examples = SLOW_EXAMPLES if operation.label in SLOW else EXAMPLES
        inputs = operation.body or any(
            p.name != "Authorization" for p in operation.iter_parameters()
        )
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if inputs else [])
        for mode in modes:
            try:
                _fuzz(world, operation, mode, examples)
            except (Exception, BaseExceptionGroup) as error:  # report every operation
                failures.append(f"{operation.label} ({mode.value}): {_describe(error)}")
    assert not failures, "\n\n".join(failures)


#: what a typed generator never draws but a client can send: strings that are not text (a lone
#: surrogate; NUL, which PostgreSQL refuses) and numbers at and past every edge
HOSTILE = st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "x\x00y", 5e-324, -5e-324, 1e300, -1e300, 2**63, 2**31, -1, 0]
)
HOSTILE_EXAMPLES = 10  # per operation with a JSON body


def _leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON value: each item's path (its last part a key or an index)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return [path]
    return [path, *(leaf for key, item in items for leaf in _leaves(item, (*path, key)))]


def _mutated(body: Any, path: tuple, hostile: Any, rename: bool) -> Any:
    """``body`` with the value at ``path`` replaced by ``hostile``, or (``rename``, a string
    ``hostile`` and a key at ``path``) that key renamed to it."""
    if not path:
        return hostile
    body = copy.deepcopy(body)
    *parents, last = path
    node = body
    for part in parents:
        node = node[part]
    if rename and isinstance(node, dict) and isinstance(hostile, str):
        node[hostile] = node.pop(last)
    else:
        node[last] = hostile
    return body


def _fuzz_hostile(world: World, operation: Any) -> None:
    internal = operation.path.startswith("/internal/")
    auth = world.internal_auth if internal else world.auth
    known = {name: values for name, values in world.ids.items() if name in operation.path}

    @hypothesis_settings(
        max_examples=HOSTILE_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        who=st.sampled_from(sorted(auth)),
        real=st.fixed_dictionaries({name: st.sampled_from(v) for name, v in known.items()}),
        where=st.integers(min_value=0),
        hostile=HOSTILE,
        rename=st.booleans(),
    )
    def check(case: Any, who: str, real: dict[str, int], where: int, hostile: Any, rename: bool):
        if isinstance(case.path_parameters, dict):
            case.path_parameters.update(real)
        leaves = _leaves(case.body)
        body = _mutated(case.body, leaves[where % len(leaves)], hostile, rename)
        path = operation.path.format(**(case.path_parameters or {}))
        before = state(world.engine)
        response = httpx.request(
            operation.method.upper(),
            f"{world.url}{path}",
            headers=auth[who] | {"content-type": "application/json"},
            content=json.dumps(body),
            timeout=120,
        )
        assert response.status_code < 500, (body, response.text[:300])
        json.loads(response.content.decode("utf-8") or "null")  # renders, whatever it echoes
        if 400 <= response.status_code < 500:
            assert state(world.engine) == before, (body, response.text[:300])

    check()


def test_fuzz_hostile_values_in_every_body(world: World) -> None:
    """Each operation with a JSON body, a valid request with one value or key replaced by a
    hostile one: never a 5xx, a body that renders, and nothing changed by a refusal."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{world.url}/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    failures = []
    for operation in operations:
        if operation.body and any(b.media_type == "application/json" for b in operation.body):
            try:
                _fuzz_hostile(world, operation)
            except (Exception, BaseExceptionGroup) as error:  # report every operation
                failures.append(f"{operation.label}: {_describe(error)}")
    assert not failures, "\n\n".join(failures)


TOO_LARGE = [2**31, 2**63, 2**80]  # past PostgreSQL's integer, SQLite's, any


@pytest.mark.parametrize("number", TOO_LARGE)
def test_ids_past_the_database_are_refused_not_overflowed(api, dataset, ana, spec, number):
    """Found by the fuzzer: an id larger than the database's integer reached a query and
    overflowed there (OverflowError on SQLite, NumericValueOutOfRange on PostgreSQL): HTTP 500.
    Each is now a 422 that names the field, and nothing is spent."""
    before = api.budget(dataset["id"])
    requests = [
        ("GET", f"/v1/jobs/{number}", api.operator, None, "job_id"),
        ("POST", f"/v1/jobs/{number}/cancel", ana, None, "job_id"),
        ("GET", f"/v1/datasets/{number}/budget", ana, None, "dataset_id"),
        ("GET", f"/v1/jobs?dataset={number}", ana, None, "dataset"),
        ("GET", f"/v1/jobs?offset={number}", ana, None, "offset"),
        ("POST", "/v1/keys", api.operator, {"role": "analyst", "datasets": [number]}, "datasets"),
        ("POST", "/v1/jobs", ana, spec(number), "dataset"),
        ("POST", "/v1/plans", ana, spec(number), "dataset"),
        ("GET", f"/internal/v1/jobs/{number}", ana, None, "job_id"),
    ]
    for method, path, headers, body, named in requests:
        r = api.client.request(method, path, headers=headers, json=body)
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.json()["errors"][0]["field"].startswith(named), (path, r.text)
    assert api.budget(dataset["id"]) == before


def test_runner_numbers_past_the_database_are_refused(api, dataset, spec):
    """The runner's token cannot overflow a column either (steps, trial index, attempt id)."""
    recorder = Recorder()
    api.client.app.state.orchestrator = recorder
    job = api.client.post("/v1/jobs", headers=api.operator, json=spec(dataset["id"])).json()
    runner = _bearer(recorder.tokens[job["id"]])
    base = f"/internal/v1/jobs/{job['id']}"
    assert api.client.post(f"{base}/start", headers=runner).status_code == 204
    attempt = api.client.post(f"{base}/attempts", headers=runner, json={"index": 0, "params": {}})
    assert attempt.status_code == 201, attempt.text
    number = attempt.json()["attempt"]
    before = api.budget(dataset["id"])
    requests = [
        ("POST", f"{base}/attempts", {"index": 2**31, "params": {}}, "index"),
        ("POST", f"{base}/attempts/{number}/progress", {"steps": 2**31, "metrics": []}, "steps"),
        ("POST", f"{base}/attempts/{number}/finish", {"status": "failed", "steps": 2**63}, "steps"),
        ("POST", f"{base}/attempts/{2**63}/finish", {"status": "failed", "steps": 1}, "attempt_id"),
        ("POST", f"{base}/trials/{2**31}/fail-open", None, "index"),
    ]
    for method, path, body, named in requests:
        r = api.client.request(method, path, headers=runner, json=body)
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.json()["errors"][0]["field"] == named, (path, r.text)
    assert api.budget(dataset["id"]) == before


def test_runner_bodies_with_nan_are_refused(api, dataset, spec):
    """Python's JSON parser reads NaN and Infinity, which are not JSON: in a trial's params or
    metrics they were stored on SQLite (and charged an attempt) and made PostgreSQL fail (HTTP
    500). Now a 422 naming the field, with nothing recorded or charged."""
    recorder = Recorder()
    api.client.app.state.orchestrator = recorder
    job = api.client.post("/v1/jobs", headers=api.operator, json=spec(dataset["id"])).json()
    runner = _bearer(recorder.tokens[job["id"]]) | {"Content-Type": "application/json"}
    base = f"/internal/v1/jobs/{job['id']}"
    assert api.client.post(f"{base}/start", headers=runner).status_code == 204
    before = api.budget(dataset["id"])
    bad = b'{"index": 0, "params": {"optimizer.lr": NaN}}'
    r = api.client.post(f"{base}/attempts", headers=runner, content=bad)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "params.optimizer.lr"
    assert api.budget(dataset["id"]) == before
    attempt = api.client.post(f"{base}/attempts", headers=runner, json={"index": 0, "params": {}})
    assert attempt.status_code == 201, attempt.text
    number = attempt.json()["attempt"]
    bad = b'{"steps": 1, "metrics": [{"name": "loss", "value": {"mean": Infinity}}]}'
    r = api.client.post(f"{base}/attempts/{number}/progress", headers=runner, content=bad)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"].startswith("metrics.0")
    trials = api.client.get(f"/v1/jobs/{job['id']}/trials", headers=api.operator).json()
    assert trials[0]["metrics"] == [] and trials[0]["params"] == {}
