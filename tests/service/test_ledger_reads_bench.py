"""``bench/ledger_reads.py`` at CI size: a ledger of a few hundred rows written through the real
functions, then budget reads and admissions over HTTP against a uvicorn-served API — on
SQLite, and on PostgreSQL when the ``database_url`` fixture names one. The running sums give
the all-rows budget to the bit (with a second dataset's newer rows in the ledger), and reading
them costs less than composing every row."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def reads(bench) -> ModuleType:
    return bench("ledger_reads")


def test_reads_at_ci_size(reads, database_url, tmp_path) -> None:
    result = reads.run_reads(database_url, tmp_path, rows=200, requests=20, other_rows=100)
    assert result.exact
    assert result.other_rows >= 100
    assert result.rows >= 200 and result.open_jobs == reads.OPEN_JOBS
    assert set(result.kinds) == {"reservation", "charge", "release"}
    assert 0 < result.spent < result.committed < reads.BUDGET
    latency = result.latency
    assert set(latency) == {
        reads.READ,
        reads.READ_ONE,
        reads.ADMIT,
        reads.ADMIT_ONLY,
        reads.CACHED,
        reads.ALL_ROWS,
        reads.OLD_GET,
    }
    assert all(v["n"] > 0 for v in latency.values())
    assert latency[reads.CACHED]["p50_ms"] < latency[reads.ALL_ROWS]["p50_ms"]
    assert "| GET /v1/datasets/{id}/budget |" in reads.table([result])
