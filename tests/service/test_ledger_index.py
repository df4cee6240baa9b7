"""A budget read lists a dataset's newest ledger rows, and the ledger endpoint pages through
them after a row id. Both must read only the rows they return, whatever the ledger's size: the
database must hand the dataset's rows over in id order from an index. With an index on
``dataset_id`` alone, PostgreSQL read all of a dataset's rows and sorted them (6 ms at 2,000
rows; issue 15, goal 4). These tests run the real requests, catch the statements they send and
ask the database for its plan of each, on a ledger of two datasets, before and after the
database has gathered statistics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, insert, text

from service.db import LedgerEntry

BIG, SMALL = 3000, 300


def _fill(engine: Engine, big: int, small: int) -> None:
    """Ledger rows straight into the table: ``small``'s rows first, then ``big``'s, so that
    scanning all ids from the newest down passes every row of ``big`` before ``small``'s."""
    rows = [(small, i) for i in range(SMALL)] + [(big, i) for i in range(BIG)]
    values = [
        {"dataset_id": d, "reference": f"d{d}-{i}", "kind": "charge", "epsilon": 0.001}
        for d, i in rows
    ]
    with engine.begin() as conn:
        conn.execute(insert(LedgerEntry), values)


def _ledger_reads(engine: Engine, client: Any, path: str, headers: Any) -> list[tuple[str, Any]]:
    """The statements on ``ledger_entry`` with a LIMIT that a GET of ``path`` sends, with
    their parameters."""
    seen: list[tuple[str, Any]] = []

    def catch(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM ledger_entry" in statement and "LIMIT" in statement:
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", catch)
    try:
        r = client.get(path, headers=headers)
        assert r.status_code == 200, r.text
    finally:
        event.remove(engine, "before_cursor_execute", catch)
    return seen


def _postgres_plan(engine: Engine, statement: str, parameters: Any) -> Iterator[dict[str, Any]]:
    with engine.connect() as conn:
        raw = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
    nodes = [(json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]]
    while nodes:
        node = nodes.pop()
        yield node
        nodes += node.get("Plans", [])


def _check_postgres(engine: Engine, statement: str, parameters: Any, few: bool) -> None:
    nodes = list(_postgres_plan(engine, statement, parameters))
    keys = ("Node Type", "Relation Name", "Index Name", "Scan Direction", "Index Cond", "Filter")
    plan = [{k: n[k] for k in keys if k in n} for n in nodes]
    assert not [n for n in plan if n["Node Type"] == "Sort"], plan
    scans = [n for n in plan if n.get("Relation Name") == "ledger_entry"]
    assert len(scans) == 1, plan
    assert scans[0]["Node Type"] in ("Index Scan", "Index Only Scan"), plan
    if few:  # not a walk down all ids that filters on the dataset
        assert "dataset_id" in scans[0].get("Index Cond", ""), plan


def _check_sqlite(engine: Engine, statement: str, parameters: Any, few: bool) -> None:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
        plan = [row[-1] for row in rows]
    assert not [p for p in plan if "TEMP B-TREE" in p], plan
    if few:
        assert [p for p in plan if p.startswith("SEARCH ledger_entry") and "dataset_id=" in p], plan


@pytest.mark.parametrize("statistics", [False, True], ids=["fresh", "analyzed"])
def test_newest_rows_and_pages_are_read_in_index_order(api, ana, dataset, statistics) -> None:
    small = dataset["id"]
    big = api.register(name="other")["id"]
    engine: Engine = api.client.app.state.sessions.kw["bind"]
    _fill(engine, big, small)
    if statistics:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
    check = _check_postgres if engine.dialect.name == "postgresql" else _check_sqlite

    checked = 0
    for d, who in [(small, ana), (small, api.operator), (big, api.operator)]:
        for path in (f"/v1/datasets/{d}/budget", f"/v1/datasets/{d}/ledger?after=10"):
            for statement, parameters in _ledger_reads(engine, api.client, path, who):
                check(engine, statement, parameters, few=d == small)
                checked += 1
    assert checked == 6
