"""Budget reads as the ledger grows: ``GET /v1/datasets/{id}/budget`` and admissions on a
dataset with 10,000 ledger rows, SQLite and PostgreSQL side by side.

    python bench/ledger_reads.py --json reads.json                # SQLite, 10,000 rows
    python bench/ledger_reads.py --postgres URL --json reads.json # and PostgreSQL
    python bench/ledger_reads.py --rows 400 --requests 40         # a quick look

Each database gets a fresh ``dptune`` API served by uvicorn in its own process (as
``bench/service_load.py`` serves it: the real app, with the default NullOrchestrator, so
admitted jobs are reserved and never run). The ledger is written in this process, against the
same database, by the ledger's own functions, which keep its running sums (:func:`fill`):
settled jobs — most ran both trials, some retried one, some were cancelled before they
started — until the dataset has ``--rows`` rows, and a few jobs left open (admitted and
charged one trial through the real admission and attempt calls). Then ``--other-rows`` rows
of a second dataset, written the same way: the measured dataset's rows are then all older
than another's, as when its budget is read while a busier dataset's ledger grows. (With an
index on ``dataset_id`` alone, PostgreSQL would walk the newer rows or sort the dataset's:
``tests/service/test_ledger_index.py``.)

Then, over HTTP, one request at a time: ``--requests`` budget reads, and ``--requests`` admissions
(each admitted job is cancelled afterwards, untimed, so the open jobs stay few). In this process,
the same database: the budget from the running sums (:func:`service.ledger.budget`, what both
requests read) against the budget composed from every row (:func:`service.ledger.budget_from_rows`,
the composition the running sums stand for), and a ``GET /budget`` without the running sums (all
rows composed, and all rows loaded to be listed: ``OLD_GET``). The run fails unless the two budgets
are equal to the bit. (Converting a total to ε is memoized, so the running-sums row is mostly what a
repeated read of an unchanged ledger costs.)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

sys.path.insert(0, str(Path(__file__).parent))
from service_load import OPERATOR_KEY, fresh_postgres, percentiles, serve

from core import accounting
from core.spec import JobSpec
from service import ledger, lifecycle
from service.attempts import start_attempt
from service.auth import Principal, authenticate
from service.db import Dataset, Job, LedgerEntry, create_db_engine, locked_dataset
from service.orchestration import JobState
from service.planning import PlannedJob, plan_job
from service.settings import Settings

ROWS = 10_000
OPEN_JOBS = 5
BUDGET = 100.0  # the largest ε a dataset may have: what fits ROWS rows of these jobs
READ, READ_ONE, ADMIT = (
    "GET /v1/datasets/{id}/budget",
    "GET /v1/datasets/{id}/budget?limit=1",
    "POST /v1/jobs",
)
CACHED, ALL_ROWS, OLD_GET = "budget (running sums)", "budget_from_rows", "old GET /budget work"
ADMIT_ONLY = "lifecycle.admit (budget check + reservation)"


def job_spec(dataset: int) -> dict[str, Any]:
    """An rdp job of two trials, one retry each reserved, a noisy private score."""
    return {
        "dataset": dataset,
        "model": {"name": "mlp"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "validation": {"split": "private", "noise": 50.0},
        "epochs": 1,
        "batch_size": 64,
        "search_space": {"optimizer.lr": {"grid": [0.05, 0.2]}},
        "privacy": {"epsilon": 0.5, "accounting": "rdp", "max_retries": 1},
    }


@dataclass
class ReadsResult:
    database: str
    rows: int
    kinds: dict[str, int]
    jobs: int
    open_jobs: int
    fill_s: float
    other_rows: int = 0  # rows of a second dataset, all newer than the measured one's
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    exact: bool = False
    spent: float = 0.0
    committed: float = 0.0


def fill(sessions: sessionmaker, dataset_id: int, rows: int, seed: int = 0) -> int:
    """Write about ``rows`` ledger rows with the ledger's own functions; returns the jobs'
    count. Settled jobs are copies of one admitted through :func:`service.lifecycle.admit`,
    their rows written by :func:`service.ledger.append` and :func:`service.ledger.settle` (which
    keep the running sums), 50 jobs to a transaction holding the budget lock: most ran both
    trials (4 rows: reservation, two charges, the release of the unused retries), some retried
    one (5 rows), some were cancelled before they started (2 rows). The last jobs stay open:
    admitted and one trial charged (:func:`service.attempts.start_attempt`)."""
    rng = random.Random(seed)
    with sessions() as session:
        principal = authenticate(session, OPERATOR_KEY)
        assert principal is not None
        spec = JobSpec.model_validate(job_spec(dataset_id))
        planned = plan_job(spec, session.get(Dataset, dataset_id), session)
        template = session.get(Job, _admit(session, principal, spec, planned))
        lifecycle.apply_state(session, template.id, JobState.CANCELLED)
        reservation = ledger.amount(planned.reservation)
        trial, first = _attempt_charges(template, reservation)
        written, jobs = 2, 1
        while written < rows - 2 * OPEN_JOBS:
            locked_dataset(session, dataset_id)
            for _ in range(min(50, (rows - 2 * OPEN_JOBS - written) // 4 + 1)):
                shape = rng.random()
                charges = 0 if shape < 0.15 else 2 if shape < 0.85 else 3
                job = Job(
                    dataset_id=dataset_id,
                    owner_key_id=principal.key_id,
                    request_sha256=template.request_sha256,
                    spec=template.spec,
                    plan=template.plan,
                    accounting=template.accounting,
                    status=JobState.SUCCEEDED if charges else JobState.CANCELLED,
                )
                session.add(job)
                session.flush()
                ledger.append(session, job, "reservation", f"job:{job.id}:reservation", reservation)
                for n in range(charges):
                    charge = first if n == 0 else trial
                    ledger.append(session, job, "charge", f"job:{job.id}:{n}", charge)
                ledger.settle(session, job)
                written += 2 + charges
                jobs += 1
            session.commit()
        for _ in range(OPEN_JOBS):  # running, one trial charged
            job_id = _admit(session, principal, spec, planned)
            start_attempt(session, job_id, 0, {"optimizer.lr": 0.05})
            jobs += 1
    return jobs


def _attempt_charges(job: Job, reservation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An attempt's charge, and a job's first attempt's, as
    :func:`service.ledger.charge_what_ran` writes them: a job stated by PLD on the ledger's
    route B is charged its whole pair there with its first attempt, nothing with the others."""
    charge = ledger.amount(accounting.Charge(rdp=ledger.attempt_rdp(job, {})))
    half = len(charge) // 2
    if np.array_equal(reservation[:half], reservation[half:]):
        return charge, charge
    later = np.concatenate([charge[:half], np.zeros(half)])
    return later, np.concatenate([charge[:half], reservation[half:]])


def _admit(session: Session, principal: Principal, spec: JobSpec, planned: PlannedJob) -> int:
    job, _ = lifecycle.admit(session, principal, spec, planned, None)
    return job.id


def timed(call: Callable[[], Any], repeat: int, warm_up: int = 10) -> list[float]:
    """Seconds of each of ``repeat`` calls, after ``warm_up`` untimed ones (the first
    requests of a kind compile its SQL and fill the caches; one is enough for the calls that
    take seconds)."""
    for _ in range(warm_up):
        call()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def run_reads(
    database_url: str | None,
    data_dir: Path,
    rows: int = ROWS,
    requests: int = 200,
    other_rows: int = 0,
) -> ReadsResult:
    """Fill one fresh database's dataset with ``rows`` ledger rows, then another dataset with
    ``other_rows`` (if any), and time the first one's reads."""
    with serve(database_url, data_dir, workers=1) as url:
        operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        with httpx.Client(base_url=url, headers=operator, timeout=120) as http:
            r = http.post(
                "/v1/datasets",
                json={"name": "d", "source": "builtin:digits", "epsilon": BUDGET, "delta": 1e-5},
            )
            r.raise_for_status()
            dataset_id = r.json()["id"]
            settings = Settings(
                data_dir=data_dir, database_url=database_url, operator_key=OPERATOR_KEY
            )
            engine = create_db_engine(settings.sqlalchemy_url)
            sessions = sessionmaker(engine, expire_on_commit=False)
            start = time.perf_counter()
            jobs = fill(sessions, dataset_id, rows)
            other = _other_dataset(http, sessions, other_rows)
            fill_s = time.perf_counter() - start
            gc.collect()
            gc.freeze()  # this process's collections must not pause the timed requests
            try:
                result = _in_process(sessions, dataset_id, requests)
                path = f"/v1/datasets/{dataset_id}/budget"
                result.latency[READ] = percentiles(
                    timed(lambda: http.get(path).raise_for_status(), requests)
                )
                one = {"limit": 1}
                result.latency[READ_ONE] = percentiles(
                    timed(lambda: http.get(path, params=one).raise_for_status(), requests)
                )
                result.latency[ADMIT] = percentiles(_admissions(http, dataset_id, requests))
            finally:
                gc.unfreeze()
            result.database = "postgresql" if database_url else "sqlite"
            result.jobs, result.fill_s, result.other_rows = jobs, fill_s, other
            engine.dispose()
    return result


def _other_dataset(http: httpx.Client, sessions: sessionmaker, rows: int) -> int:
    """A second dataset with about ``rows`` ledger rows (:func:`fill`); their count."""
    if rows <= 0:
        return 0
    r = http.post(
        "/v1/datasets",
        json={"name": "newer", "source": "builtin:digits", "epsilon": BUDGET, "delta": 1e-5},
    )
    r.raise_for_status()
    other = r.json()["id"]
    fill(sessions, other, rows, seed=1)
    with sessions() as session:
        count = select(func.count()).where(LedgerEntry.dataset_id == other)
        return int(session.execute(count).scalar_one())


def _in_process(sessions: sessionmaker, dataset_id: int, requests: int) -> ReadsResult:
    with sessions() as session:
        dataset = session.get(Dataset, dataset_id)
        cached = ledger.budget(session, dataset)
        exact = cached == ledger.budget_from_rows(session, dataset)
        kinds = dict(
            session.execute(
                select(LedgerEntry.kind, func.count())
                .where(LedgerEntry.dataset_id == dataset_id)
                .group_by(LedgerEntry.kind)
            ).all()
        )
        principal = authenticate(session, OPERATOR_KEY)
        assert principal is not None
        open_jobs = sum(any(v) for v in ledger.outstanding(ledger.entries_of(session, dataset_id)))
        slow = 3  # composing every row takes seconds at 10,000 rows

        def old_get() -> None:
            ledger.budget_from_rows(session, dataset)
            ledger.entries_of(session, dataset_id)

        spec = JobSpec.model_validate(job_spec(dataset_id))
        planned = plan_job(spec, dataset, session)
        session.commit()

        def admit_and_cancel() -> float:
            """Seconds of one admission (locked budget check, reservation, commit); the job is
            then cancelled, untimed."""
            start = time.perf_counter()
            job_id = _admit(session, principal, spec, planned)
            seconds = time.perf_counter() - start
            lifecycle.apply_state(session, job_id, JobState.CANCELLED)
            return seconds

        latency = {
            ADMIT_ONLY: percentiles([admit_and_cancel() for _ in range(requests)]),
            CACHED: percentiles(timed(lambda: ledger.budget(session, dataset), requests)),
            ALL_ROWS: percentiles(
                timed(lambda: ledger.budget_from_rows(session, dataset), slow, warm_up=1)
            ),
            OLD_GET: percentiles(timed(old_get, slow, warm_up=1)),
        }
    return ReadsResult(
        database="",
        rows=sum(kinds.values()),
        kinds=kinds,
        jobs=0,
        open_jobs=open_jobs,
        fill_s=0.0,
        latency=latency,
        exact=exact,
        spent=cached.spent,
        committed=cached.committed,
    )


def _admissions(http: httpx.Client, dataset_id: int, requests: int) -> list[float]:
    """Time each admission; cancel the job afterwards (untimed) so the open jobs stay few."""
    body = job_spec(dataset_id)
    http.post("/v1/plans", json=body).raise_for_status()  # the plan is cached, as in use
    seconds = []
    for _ in range(requests):
        start = time.perf_counter()
        r = http.post("/v1/jobs", json=body)
        seconds.append(time.perf_counter() - start)
        if r.status_code != 202:
            raise RuntimeError(f"admission refused: {r.status_code} {r.text}")
        http.post(f"/v1/jobs/{r.json()['id']}/cancel").raise_for_status()
    return seconds


def table(results: list[ReadsResult]) -> str:
    names = [r.database for r in results]
    counts = [
        f"{r.database} {r.rows} ({r.jobs} jobs, {r.open_jobs} open"
        + (f"; then {r.other_rows} rows of another dataset)" if r.other_rows else ")")
        for r in results
    ]
    lines = [
        f"ledger rows: {', '.join(counts)}",
        "",
        "| what (one at a time) | " + " | ".join(f"{n} p50 ms | {n} p99 ms" for n in names) + " |",
        "|---|" + "---:|---:|" * len(results),
    ]
    for what in (READ, READ_ONE, ADMIT, ADMIT_ONLY, CACHED, ALL_ROWS, OLD_GET):
        cells = [
            f"{r.latency[what]['p50_ms']:.2f} | {r.latency[what]['p99_ms']:.2f}" for r in results
        ]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    for r in results:
        ratio = r.latency[ALL_ROWS]["p50_ms"] / r.latency[CACHED]["p50_ms"]
        lines.append(
            f"\n{r.database}: running sums {ratio:.0f}× faster than composing every row (p50); "
            f"equal to the bit: {r.exact}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--other-rows",
        type=int,
        default=ROWS,
        help="ledger rows of a second dataset, written after the measured one's (0: none)",
    )
    parser.add_argument("--postgres", help="a PostgreSQL server URL (a database is made there)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    with TemporaryDirectory() as tmp:
        sizes = (args.rows, args.requests, args.other_rows)
        results.append(run_reads(None, Path(tmp) / "sqlite", *sizes))
        if args.postgres:
            with fresh_postgres(args.postgres) as url:
                results.append(run_reads(url, Path(tmp) / "pg", *sizes))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    if not all(r.exact for r in results):
        raise SystemExit("the running sums differ from the all-rows budget")


if __name__ == "__main__":
    main()
