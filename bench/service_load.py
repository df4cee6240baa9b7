"""Load on the control plane: concurrent job submissions against one budget, SQLite and
PostgreSQL side by side.

    python bench/service_load.py --json load.json          # 1000 submissions, 128 in flight
    python bench/service_load.py --quick                   # 200 submissions, 32 in flight
    python bench/service_load.py --postgres URL --workers 2

Each database gets a fresh ``dptune`` API served by uvicorn in its own process (``--workers``
processes; jobs admitted and reserved by the default NullOrchestrator, never run) and one
dataset whose budget fits only some of the jobs. Analysts submit identical Liu–Talwar jobs,
each with its own ``Idempotency-Key`` (a tenth of the keys sent twice, as a client retrying
would), while other analysts read the budget, all at once with ``--concurrency`` requests in
flight. Liu–Talwar jobs are (ε, δ) charges, which the ledger adds by basic composition
(docs/design.md, invariant 7), so how many fit is exact arithmetic on the plan's ε and δ:
the largest n with n·ε ≤ ε_budget and n·δ ≤ δ_budget, computed here in rationals. The run
fails unless exactly that many distinct jobs are admitted, every other submission is refused
with 409, no request gets a 5xx, no budget read ever shows more committed than the budget,
every replayed key returns its job, and the ledger holds one reservation per admitted job.
A submission the service sheds (429 or 503 with ``Retry-After``: its planning queue is full)
is sent again after that many seconds, as a client should; the count of those is reported.

Prints a table (p50/p99 latency per endpoint, throughput, PostgreSQL/SQLite ratios) and
writes every number as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import numpy as np
from sqlalchemy import create_engine, make_url

from service.api import create_app
from service.api.server import free_port
from service.settings import Settings

OPERATOR_KEY = "dpt_load-benchmark-operator-key-0123"
JOB_EPSILON = 0.5  # each job's target ε (the planner lands at or just below it)
JOB_DELTA = 1e-8
DATASET_DELTA = 1e-5
ANALYSTS = 8
SUBMIT, READ = "POST /v1/jobs", "GET /v1/datasets/{id}/budget"


def job_spec(dataset: int) -> dict[str, Any]:
    """A Liu–Talwar job: its reservation is the (ε, δ) pair of its plan, nothing else."""
    return {
        "dataset": dataset,
        "model": {"name": "mlp"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "validation": {"split": "public"},
        "epochs": 1,
        "batch_size": 64,
        "search_space": {"optimizer.lr": {"log_uniform": [0.01, 0.5]}},
        "privacy": {
            "epsilon": JOB_EPSILON,
            "accounting": "lt",
            "expected_trials": 4,
            "delta": JOB_DELTA,
        },
    }


def expected_admitted(
    job_epsilon: float, job_delta: float, budget_epsilon: float, budget_delta: float
) -> int:
    """How many (ε, δ) charges fit by basic composition: the largest n with n·ε and n·δ within
    the budget, in exact rationals. Refuses a budget where the answer changes within float
    rounding of it (a multiple of the job's charge), where the service's float sums could go
    either way."""
    counts = {
        min(
            int(Fraction(budget_epsilon) * slack // Fraction(job_epsilon)),
            int(Fraction(budget_delta) * slack // Fraction(job_delta)),
        )
        for slack in (1 - Fraction(1, 10**9), 1 + Fraction(1, 10**9))
    }
    if len(counts) > 1:
        raise ValueError(f"the budget is a multiple of the job's charge: {sorted(counts)} fit")
    return counts.pop()


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000
    return {
        "n": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


@dataclass
class LoadResult:
    database: str
    submissions: int  # requests, replays included
    keys: int  # distinct Idempotency-Keys
    reads: int
    concurrency: int
    workers: int
    budget_epsilon: float
    job_epsilon: float
    expected_admitted: int
    admitted: int  # distinct jobs
    refused: int  # submissions answered 409
    shed: int  # submissions answered 429 or 503 with Retry-After, and sent again
    statuses: dict[str, dict[str, int]]  # endpoint -> status code -> count
    server_errors: int
    committed_epsilon: float  # spent + reserved, at the end
    max_committed_seen: float  # the most any concurrent budget read showed
    ledger_rows: int
    wall_s: float
    requests_per_s: float
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@contextmanager
def serve(database_url: str | None, data_dir: Path, workers: int) -> Iterator[str]:
    """A dptune API in its own process(es): uvicorn with ``workers`` processes, settings from
    the environment. The schema and the operator key are set up once beforehand by running
    the app's lifespan here, so the workers do not race to create them."""
    env = os.environ | {"DPTUNE_DATA_DIR": str(data_dir), "DPTUNE_OPERATOR_KEY": OPERATOR_KEY}
    env.pop("DPTUNE_DATABASE_URL", None)
    if database_url is not None:
        env["DPTUNE_DATABASE_URL"] = database_url
    app = create_app(
        Settings(data_dir=data_dir, database_url=database_url, operator_key=OPERATOR_KEY)
    )

    async def setup() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(setup())
    port = free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "--factory", "service.api:create_app"),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)),
            *("--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "600"),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the API exited with {server.returncode} before serving")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API did not answer on {url}")
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextmanager
def fresh_postgres(server_url: str) -> Iterator[str]:
    """A new, empty database on the PostgreSQL server at ``server_url``, dropped afterwards."""
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = f"dptune_load_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
        admin.dispose()


def _whole_ledger(http: httpx.Client, dataset: int) -> list[dict[str, Any]]:
    """Every ledger row of the dataset, a page at a time (a budget lists the newest only)."""
    entries: list[dict[str, Any]] = []
    after: int | None = 0
    while after is not None:
        page = http.get(
            f"/v1/datasets/{dataset}/ledger",
            headers=_bearer(OPERATOR_KEY),
            params={"after": after, "limit": 1000},
        )
        _ok(page)
        entries += page.json()["entries"]
        after = page.json()["next_after"]
    return entries


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ok(response: httpx.Response) -> None:
    if response.is_error:
        raise RuntimeError(
            f"{response.request.url} answered {response.status_code}: {response.text}"
        )


def _prepare(url: str, budget_epsilon: float) -> tuple[int, list[dict[str, str]], dict]:
    """Register the dataset, make the analysts' keys, and plan the job (which also warms
    the planner's cache in the process that answers)."""
    operator = _bearer(OPERATOR_KEY)
    with httpx.Client(base_url=url, timeout=300) as http:
        r = http.post(
            "/v1/datasets",
            headers=operator,
            json={
                "name": "load",
                "source": "builtin:digits",
                "epsilon": budget_epsilon,
                "delta": DATASET_DELTA,
            },
        )
        _ok(r)
        dataset = r.json()["id"]
        analysts = []
        for i in range(ANALYSTS):
            r = http.post(
                "/v1/keys",
                headers=operator,
                json={"name": f"analyst-{i}", "role": "analyst", "datasets": [dataset]},
            )
            _ok(r)
            analysts.append(_bearer(r.json()["secret"]))
        r = http.post("/v1/plans", headers=analysts[0], json=job_spec(dataset))
        _ok(r)
        return dataset, analysts, r.json()


async def _fire(
    url: str,
    dataset: int,
    analysts: list[dict[str, str]],
    submissions: list[str],
    reads: int,
    concurrency: int,
) -> tuple[list[tuple[str, str, httpx.Response | None, float, str]], float, int]:
    """Send every submission (one per key in ``submissions``) and ``reads`` budget reads in a
    shuffled order, ``concurrency`` at a time; a submission that is shed is sent again after
    its ``Retry-After``. Returns (endpoint, key, response, seconds, transport error) per
    request, the wall time, and how many times submissions were shed."""
    body = job_spec(dataset)
    calls: list[tuple[str, str]] = [(SUBMIT, key) for key in submissions] + [(READ, "")] * reads
    random.shuffle(calls)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    shed = 0

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def call(i: int, endpoint: str, key: str) -> tuple:
            headers = analysts[i % len(analysts)]
            async with gate:
                start = time.perf_counter()
                try:
                    if endpoint == SUBMIT:
                        response = await submit(key)
                    else:
                        response = await http.get(f"/v1/datasets/{dataset}/budget", headers=headers)
                except httpx.TransportError as error:
                    return endpoint, key, None, time.perf_counter() - start, repr(error)
                return endpoint, key, response, time.perf_counter() - start, ""

        async def submit(key: str) -> httpx.Response:
            nonlocal shed
            auth = analysts[hash(key) % len(analysts)]  # a key has one owner
            while True:
                response = await http.post(
                    "/v1/jobs", headers=auth | {"Idempotency-Key": key}, json=body
                )
                retry_after = response.headers.get("retry-after")
                if response.status_code not in (429, 503) or retry_after is None:
                    return response
                shed += 1
                await asyncio.sleep(float(retry_after) * random.uniform(0.5, 1.5))

        start = time.perf_counter()
        results = await asyncio.gather(*(call(i, e, k) for i, (e, k) in enumerate(calls)))
        return list(results), time.perf_counter() - start, shed


def run_load(
    database_url: str | None,
    data_dir: Path,
    *,
    submissions: int,
    concurrency: int,
    reads: int | None = None,
    admitted: int | None = None,
    workers: int = 1,
) -> LoadResult:
    """One run against a fresh API on ``database_url`` (None: SQLite under ``data_dir``).
    ``submissions`` requests in all, a tenth of them replays of an earlier key; the budget
    fits about ``admitted`` jobs (default: a fifth of the keys); ``reads`` budget reads (default
    half the submissions). Checks are collected in ``problems`` (empty: all held)."""
    replays = submissions // 10
    keys = [f"load-{uuid.uuid4().hex}" for _ in range(submissions - replays)]
    sent = keys + random.sample(keys, replays)
    reads = submissions // 2 if reads is None else reads
    target = max(1, len(keys) // 5) if admitted is None else admitted
    # half a job's ε over a multiple, so the planner's "at or just below" cannot move n
    budget_epsilon = (target + 0.5) * JOB_EPSILON
    with serve(database_url, data_dir, workers) as url:
        dataset, analysts, plan = _prepare(url, budget_epsilon)
        expected = expected_admitted(plan["epsilon"], plan["delta"], budget_epsilon, DATASET_DELTA)
        results, wall, shed = asyncio.run(_fire(url, dataset, analysts, sent, reads, concurrency))
        with httpx.Client(base_url=url, timeout=300) as http:
            final = http.get(f"/v1/datasets/{dataset}/budget", headers=_bearer(OPERATOR_KEY))
            _ok(final)
            ledger = _whole_ledger(http, dataset)
            one_more = http.post(
                "/v1/jobs",
                headers=analysts[0] | {"Idempotency-Key": "load-one-more"},
                json=job_spec(dataset),
            )
    return _check(
        database="postgresql" if database_url else "sqlite",
        results=results,
        wall=wall,
        shed=shed,
        final=final.json() | {"entries": ledger},
        one_more=one_more,
        plan=plan,
        expected=expected,
        keys=len(keys),
        concurrency=concurrency,
        workers=workers,
    )


def _check(
    *,
    database: str,
    results: list[tuple[str, str, httpx.Response | None, float, str]],
    wall: float,
    shed: int,
    final: dict[str, Any],
    one_more: httpx.Response,
    plan: dict[str, Any],
    expected: int,
    keys: int,
    concurrency: int,
    workers: int,
) -> LoadResult:
    problems: list[str] = []
    statuses: dict[str, Counter[str]] = {SUBMIT: Counter(), READ: Counter()}
    latency: dict[str, list[float]] = {SUBMIT: [], READ: []}
    jobs_by_key: dict[str, set[int]] = {}
    refused = 0
    max_committed = 0.0
    budget = final["epsilon"]
    for endpoint, key, response, seconds, error in results:
        latency[endpoint].append(seconds)
        if response is None:
            statuses[endpoint]["transport error"] += 1
            problems.append(f"{endpoint}: {error}")
            continue
        statuses[endpoint][str(response.status_code)] += 1
        if endpoint == SUBMIT and response.status_code == 202:
            jobs_by_key.setdefault(key, set()).add(response.json()["id"])
        elif endpoint == SUBMIT and response.status_code == 409:
            refused += 1
            jobs_by_key.setdefault(key, set())
            if response.json()["errors"][0]["field"] != "privacy.epsilon":
                problems.append(f"409 for another reason: {response.text}")
        elif endpoint == READ and response.status_code == 200:
            seen = response.json()
            max_committed = max(max_committed, seen["spent"] + seen["reserved"])
        else:
            problems.append(f"{endpoint} answered {response.status_code}: {response.text[:200]}")
    server_errors = sum(
        n for counts in statuses.values() for code, n in counts.items() if code.startswith("5")
    )
    if server_errors:
        problems.append(f"{server_errors} responses with a 5xx status")
    split = [key for key, ids in jobs_by_key.items() if len(ids) > 1]
    if split:
        problems.append(f"{len(split)} replayed keys got a different job")
    admitted = len(set().union(*jobs_by_key.values())) if jobs_by_key else 0
    if admitted != expected:
        problems.append(f"admitted {admitted} jobs, expected exactly {expected}")
    committed = final["spent"] + final["reserved"]
    if committed > budget or max_committed > budget:
        problems.append(f"committed ε {max(committed, max_committed)} over the budget {budget}")
    if final["entries_total"] != len(final["entries"]):
        problems.append(f"entries_total {final['entries_total']}, {len(final['entries'])} rows")
    reservations = [e for e in final["entries"] if e["kind"] == "reservation"]
    if len(final["entries"]) != admitted or len(reservations) != admitted:
        problems.append(f"{len(final['entries'])} ledger rows for {admitted} admitted jobs")
    if any(e["epsilon"] != plan["epsilon"] for e in reservations):
        problems.append("a reservation differs from the planned ε")
    if one_more.status_code != 409:
        problems.append(f"one more job after the run answered {one_more.status_code}")
    return LoadResult(
        database=database,
        submissions=len(latency[SUBMIT]),
        keys=keys,
        reads=len(latency[READ]),
        concurrency=concurrency,
        workers=workers,
        budget_epsilon=budget,
        job_epsilon=plan["epsilon"],
        expected_admitted=expected,
        admitted=admitted,
        refused=refused,
        shed=shed,
        statuses={endpoint: dict(counts) for endpoint, counts in statuses.items()},
        server_errors=server_errors,
        committed_epsilon=committed,
        max_committed_seen=max_committed,
        ledger_rows=len(final["entries"]),
        wall_s=wall,
        requests_per_s=len(results) / wall,
        latency={endpoint: percentiles(s) for endpoint, s in latency.items() if s},
        problems=problems,
    )


def table(results: list[LoadResult]) -> str:
    """Markdown: one column per database, and PostgreSQL/SQLite where both ran."""
    rows: list[tuple[str, list[float | int | str]]] = [
        ("submissions (distinct keys)", [f"{r.submissions} ({r.keys})" for r in results]),
        ("budget reads", [r.reads for r in results]),
        ("in flight / server processes", [f"{r.concurrency} / {r.workers}" for r in results]),
        ("admitted (expected)", [f"{r.admitted} ({r.expected_admitted})" for r in results]),
        ("refused 409", [r.refused for r in results]),
        ("shed 429/503, sent again", [r.shed for r in results]),
        ("5xx", [r.server_errors for r in results]),
        (
            "committed ε / budget",
            [f"{r.committed_epsilon:.4f} / {r.budget_epsilon:g}" for r in results],
        ),
        ("wall s", [r.wall_s for r in results]),
        ("requests/s", [r.requests_per_s for r in results]),
    ]
    for endpoint in (SUBMIT, READ):
        for stat in ("p50_ms", "p99_ms"):
            rows.append((f"{endpoint} {stat[:3]} ms", [r.latency[endpoint][stat] for r in results]))
    names = [r.database for r in results]
    both = names == ["sqlite", "postgresql"]
    header = "| | " + " | ".join(names) + (" | postgresql / sqlite |" if both else " |")
    lines = [header, "|---" * (len(names) + 1 + both) + "|"]
    for label, values in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in values]
        ratio = ""
        if both and isinstance(values[0], float) and values[0] > 0:
            ratio = f" | {values[1] / values[0]:.2f}x"
        elif both:
            ratio = " | "
        lines.append(f"| {label} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 submissions, 32 in flight")
    parser.add_argument("--submissions", type=int, help="default 1000 (--quick: 200)")
    parser.add_argument("--concurrency", type=int, help="default 128 (--quick: 32)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("DPTUNE_TEST_POSTGRES_URL"),
        help="PostgreSQL server URL (default $DPTUNE_TEST_POSTGRES_URL); a fresh database "
        "is created there and dropped afterwards",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    submissions = args.submissions or (200 if args.quick else 1000)
    concurrency = args.concurrency or (32 if args.quick else 128)
    results = []
    with TemporaryDirectory() as tmp:
        kwargs = {"submissions": submissions, "concurrency": concurrency, "workers": args.workers}
        results.append(run_load(None, Path(tmp) / "sqlite", **kwargs))
        if args.postgres:
            with fresh_postgres(args.postgres) as url:
                results.append(run_load(url, Path(tmp) / "postgresql", **kwargs))
        else:
            print("PostgreSQL skipped: give --postgres URL or set DPTUNE_TEST_POSTGRES_URL")
    print(table(results))
    for r in results:
        for problem in r.problems:
            print(f"FAIL {r.database}: {problem}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
