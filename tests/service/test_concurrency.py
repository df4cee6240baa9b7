"""Concurrent admissions over real HTTP (uvicorn on 127.0.0.1) never overspend, and a
retried POST with the same Idempotency-Key charges once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session

from service import ledger
from service.api import create_app
from service.db import Dataset, create_db_engine

THREADS = 20


@pytest.fixture
def server(settings) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _post_all(url: str, headers: dict, body: dict, extra: list[dict]) -> list[httpx.Response]:
    barrier = threading.Barrier(THREADS)

    def post(i: int) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=120) as http:
            barrier.wait()
            return http.post("/v1/jobs", headers=headers | extra[i], json=body)

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(post, range(THREADS)))


def _operator(settings) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.operator_key.get_secret_value()}"}


def _digits(http: httpx.Client, op: dict[str, str], epsilon: float) -> int:
    """A digits dataset with budget ε = ``epsilon``; its id."""
    body = {"name": "digits", "source": "builtin:digits", "epsilon": epsilon, "delta": 1e-5}
    return http.post("/v1/datasets", headers=op, json=body).json()["id"]


def test_concurrent_admissions_never_overspend(server, settings, spec):
    op = _operator(settings)
    with httpx.Client(base_url=server, timeout=60) as http:
        ds = _digits(http, op, epsilon=3.0)
        body = spec(ds, epsilon=1.0)
        body["validation"] = {"split": "private", "noise": 50.0}
        plan = http.post("/v1/plans", headers=op, json=body).json()  # warms the plan cache
        assert plan["fits"]

    responses = _post_all(server, op, body, [{}] * THREADS)
    codes = sorted(r.status_code for r in responses)
    admitted = codes.count(202)
    assert set(codes) == {202, 409}, codes
    assert 1 < admitted < THREADS  # RDP composes sublinearly: more than 3 jobs of ε = 1 fit

    with httpx.Client(base_url=server, timeout=60) as http:
        budget = http.get(f"/v1/datasets/{ds}/budget", headers=op).json()
        assert len(budget["entries"]) == budget["entries_total"] == admitted
        assert budget["reserved"] <= 3.0 and budget["remaining"] >= 0
        # ... and the admitted set is maximal: one more does not fit.
        assert http.post("/v1/jobs", headers=op, json=body).status_code == 409
    # The running sums that admissions read and wrote are those of the rows, to the bit.
    engine = create_db_engine(settings.sqlalchemy_url)
    with Session(engine) as session:
        dataset = session.get(Dataset, ds)
        assert ledger.budget(session, dataset) == ledger.budget_from_rows(session, dataset)
    engine.dispose()


def test_idempotency_key_charges_once(server, settings, spec):
    op = _operator(settings)
    with httpx.Client(base_url=server, timeout=60) as http:
        ds = _digits(http, op, epsilon=10.0)
        body = spec(ds, epsilon=1.0)
        first = http.post("/v1/jobs", headers=op | {"Idempotency-Key": "a"}, json=body)
        assert first.status_code == 202
        assert "idempotent-replayed" not in first.headers
        again = http.post("/v1/jobs", headers=op | {"Idempotency-Key": "a"}, json=body)
        assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"]
        other = http.post(
            "/v1/jobs", headers=op | {"Idempotency-Key": "a"}, json=spec(ds, epsilon=2.0)
        )
        assert other.status_code == 409 and other.json()["detail"].startswith("Idempotency-Key")

    # Concurrent retries of one request: a single job, a single reservation.
    responses = _post_all(server, op, body, [{"Idempotency-Key": "b"}] * THREADS)
    assert {r.status_code for r in responses} == {202}
    assert len({r.json()["id"] for r in responses}) == 1
    with httpx.Client(base_url=server, timeout=60) as http:
        entries = http.get(f"/v1/datasets/{ds}/budget", headers=op).json()["entries"]
    assert [e["kind"] for e in entries] == ["reservation", "reservation"]
