"""``bench/ledger_reads.py`` at CI size: a ledger of a few hundred rows written through the real
functions, then budget reads and admissions over HTTP against a uvicorn-served API — on
SQLite, and on PostgreSQL when the ``database_url`` fixture names one. The running sums give
the all-rows budget to the bit, and reading them costs less than composing every row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ledger_reads.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ledger_reads", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


reads = _bench()


def test_reads_at_ci_size(database_url, tmp_path) -> None:
    result = reads.run_reads(database_url, tmp_path, rows=200, requests=20)
    assert result.exact
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
