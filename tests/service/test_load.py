"""``bench/service_load.py`` at CI size: 100 concurrent submissions (16 in flight) and budget
reads against a uvicorn-served API admit exactly as many jobs as the budget allows, never
commit more than the budget, and answer no 5xx — on SQLite, and on PostgreSQL when the
``database_url`` fixture names one."""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import httpx
import pytest

from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.db import engine


@pytest.fixture(scope="module")
def load(bench) -> ModuleType:
    return bench("service_load")


def test_expected_count_is_exact_basic_composition(load) -> None:
    assert load.expected_admitted(0.5, 1e-8, 13.75, 1e-5) == 27
    assert load.expected_admitted(0.5, 1e-6, 100.25, 1.05e-5) == 10  # δ binds first
    with pytest.raises(ValueError, match="multiple"):  # 30 × 0.1 is 3 only up to rounding
        load.expected_admitted(0.1, 1e-8, 3.0, 1e-5)


def test_concurrent_submissions_admit_exactly_what_fits(load, database_url, tmp_path) -> None:
    result = load.run_load(database_url, tmp_path, submissions=100, concurrency=16, reads=30)
    assert result.problems == []
    assert result.admitted == result.expected_admitted == 18  # a fifth of 90 keys
    assert set(result.statuses[load.SUBMIT]) == {"202", "409"}
    assert result.server_errors == 0
    assert result.shed == 0  # 16 in flight fit in the planning queue
    assert result.max_committed_seen <= result.committed_epsilon <= result.budget_epsilon
    assert result.ledger_rows == result.admitted


def test_requests_past_the_pool_wait_instead_of_failing(settings, spec, monkeypatch) -> None:
    """Found by the benchmark: with more requests in flight than database connections, threads
    waited for connections held by requests that waited for a thread, until the pool's timeout
    answered HTTP 500 — some after their job had been admitted. The API now lets in only as many
    requests at once as the pool has connections (``service.api.limits.InFlight``); here the
    pool has 2, with a 2 s timeout, and 24 requests come at once."""
    monkeypatch.setattr(engine, "POOL", {"pool_size": 2, "max_overflow": 0, "pool_timeout": 2})
    monkeypatch.setattr(importlib.import_module("service.api.app"), "POOL_SIZE", 2)
    operator = {"Authorization": f"Bearer {settings.operator_key.get_secret_value()}"}
    with BackgroundServer(create_app(settings), free_port()) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post(
                "/v1/datasets",
                headers=operator,
                json={"name": "d", "source": "builtin:digits", "epsilon": 2.0, "delta": 1e-5},
            )
            dataset = r.json()["id"]
            body = spec(dataset)
            assert http.post("/v1/plans", headers=operator, json=body).status_code == 200

        def call(i: int) -> int:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                if i % 2:
                    return http.get(f"/v1/datasets/{dataset}/budget", headers=operator).status_code
                return http.post("/v1/jobs", headers=operator, json=body).status_code

        with ThreadPoolExecutor(24) as pool:
            codes = Counter(pool.map(call, range(24)))
    assert set(codes) <= {200, 202, 409}, codes
    assert codes[202] >= 1 and codes[200] == 12
