"""Revisions 0011 (the ledger's second route) and 0012 (the dataset's privacy filter): rows
written before 0011 count the same on both routes, and the running sums gain route B as a copy
of route A, so every budget stays what it was; the downgrade takes route A back alone; rows
counted as pairs by the earlier rule count as their curves from 0012 on, and Liu–Talwar pairs
holding more than the filter's share of δ read as no ε stated (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import numpy as np
import pytest
from alembic import command
from alembic.config import Config
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from core import accounting
from dptune.models import Budget
from service import ledger
from service.api import create_app
from service.db import Dataset, Job, LedgerEntry, LedgerTotal, upgrade
from service.db.schema import MIGRATIONS, _sqlite_foreign_keys_off

from .conftest import OPERATOR_KEY, bearer, make_spec
from .test_migrations import _analyst_key, _at_revision

N = len(accounting.ORDERS)
#: a PostgreSQL table's id counter moved past the ids a test inserted itself
SET_SERIAL = "SELECT setval(pg_get_serial_sequence('{0}', 'id'), (SELECT max(id) FROM {0}))"


def _to(engine, revision: str, down: bool = False) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as conn, _sqlite_foreign_keys_off(conn), conn.begin():
        config.attributes["connection"] = conn  # as the service migrates (SQLite's batch mode)
        (command.downgrade if down else command.upgrade)(config, revision)


def _totals(engine) -> dict[int | None, list]:
    """Each running sum's parts, by job (None: the charges)."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT job_id, amount FROM ledger_total")).all()
    return {job: json.loads(a) if isinstance(a, str) else a for job, a in rows}


def _dataset_with_jobs(engine, jobs: tuple[int, ...]) -> None:
    """Dataset 1 (ε = 100, δ = 1e-3) and fixed-K jobs on it, owned by an analyst's key."""
    with engine.begin() as conn:
        _analyst_key(conn)
        conn.execute(
            text(
                "INSERT INTO dataset (id, name, source, options, n, num_classes, input_shape, "
                "public_validation, epsilon, delta, content_sha256, created_at) VALUES "
                "(1, 'd', 'builtin:digits', '{}', 10, 3, '[4]', false, 100, 1e-3, '', "
                "CURRENT_TIMESTAMP)"
            )
        )
        for job in jobs:
            conn.execute(
                text(
                    "INSERT INTO job (id, dataset_id, owner_key_id, request_sha256, spec, plan, "
                    "accounting, status, created_at) VALUES (:id, 1, 1, 'x', '{}', '{}', 'rdp', "
                    "'queued', CURRENT_TIMESTAMP)"
                ),
                {"id": job},
            )


def test_the_upgrade_copies_route_a_and_keeps_every_budget(settings):
    engine = _at_revision(settings, "0004")
    rng = np.random.default_rng(11)
    _dataset_with_jobs(engine, (1, 2, 3))
    with Session(engine) as session:
        for job in (1, 2, 3):
            reserved = np.concatenate([rng.uniform(0, 0.3, N), [0.1, 1e-6]])
            rows = [("reservation", reserved), ("charge", reserved * rng.uniform(0, 0.5))]
            for i, (kind, vec) in enumerate(rows):
                session.execute(
                    LedgerEntry.__table__.insert().values(
                        dataset_id=1,
                        job_id=job,
                        reference=f"{job}:{i}",
                        kind=kind,
                        rdp=vec[:N].tolist(),
                        epsilon=float(vec[N]),
                        delta=float(vec[N + 1]),
                        note="",
                        created_at=datetime.now(UTC),
                    )
                )
        session.commit()
    _to(engine, "0010")  # 0005 fills the sums from the rows, in the form of route A alone
    before = _totals(engine)
    assert {len(a) for a in before.values()} == {N + 2}

    upgrade(engine)
    after = _totals(engine)
    assert after == {job: amount + amount for job, amount in before.items()}
    with Session(engine) as session:
        entries = session.execute(select(LedgerEntry)).scalars().all()
        assert entries and all(e.pld_epsilon is None and e.pld_delta is None for e in entries)
        dataset = session.get(Dataset, 1)
        cached = ledger.budget(session, dataset)
        assert cached == ledger.budget_from_rows(session, dataset)
        assert 0 < cached.spent < cached.committed
        assert len(session.execute(select(LedgerTotal)).scalars().all()) == len(before)

    _to(engine, "0010", down=True)
    assert _totals(engine) == before
    engine.dispose()


def test_the_filter_recounts_earlier_pairs_as_curves(settings):
    """Revision 0012: jobs that the earlier rule counted on route B as a PLD statement holding
    the whole δ (more than the filter lets pairs hold: the total reads infinite) count as
    their curves, so the dataset's total through its filter is finite again, and the running
    sums still give the all-rows budget."""
    engine = _at_revision(settings, "0011")
    _dataset_with_jobs(engine, (1, 2))
    curve = accounting.rdp_curve(0.1, 1.0, 100)
    with Session(engine) as session:
        for job in (1, 2):
            charge = accounting.Charge(rdp=curve, pld=(2.0, 1e-3))
            vec = ledger.amount(charge, charge.pld)
            ledger.append(session, session.get_one(Job, job), "reservation", f"{job}:r", vec)
        session.commit()
        assert ledger.budget(session, session.get_one(Dataset, 1)).committed == math.inf

    upgrade(engine)
    with Session(engine) as session:
        entries = session.execute(select(LedgerEntry)).scalars().all()
        assert len(entries) == 2 and all(e.pld_epsilon is None for e in entries)
        dataset = session.get_one(Dataset, 1)
        cached = ledger.budget(session, dataset)
        assert cached == ledger.budget_from_rows(session, dataset)
        want = accounting.Filter(100.0, 1e-3).spent(2 * curve, 0.0, 0.0)
        assert cached.committed == pytest.approx(want, rel=1e-12) and cached.spent == 0.0
    engine.dispose()


def test_pairs_outgrowing_the_filters_share_read_as_no_statement(settings):
    """Liu–Talwar jobs admitted before the filter (revision 0012) may hold more of δ than the
    filter lets (ε, δ) pairs hold: then no ε can be stated at the dataset's δ. Every read says
    so with null (not an infinity a client cannot parse, nor a 500), the Python client reads
    it, and a plan shows that nothing more fits."""
    engine = _at_revision(settings, "0011")
    _dataset_with_jobs(engine, (1, 2))
    with Session(engine) as session:
        for job in (1, 2):
            vec = ledger.amount(accounting.Charge(eps_delta=(1.0, 3e-4)))
            ledger.append(session, session.get_one(Job, job), "charge", f"{job}:c", vec)
        session.commit()
    upgrade(engine)
    if engine.dialect.name == "postgresql":  # its id counters did not see the ids given above
        with engine.begin() as conn:
            for table in ("api_key", "dataset", "job"):
                conn.execute(text(SET_SERIAL.format(table)))
    engine.dispose()
    with TestClient(create_app(settings)) as client:
        budget = client.get("/v1/datasets/1/budget", headers=bearer(OPERATOR_KEY))
        assert budget.status_code == 200, budget.text
        body = budget.json()
        assert (body["epsilon"], body["delta"]) == (100.0, 1e-3)
        assert body["spent"] is body["reserved"] is body["remaining"] is None
        assert [e["delta"] for e in body["entries"]] == [3e-4, 3e-4]
        assert Budget.model_validate(body).remaining is None
        spec = make_spec(1) | {"model": {"name": "logreg"}, "batch_size": 4}
        spec["validation"] = {"split": "private", "fraction": 0.5, "noise": 20.0}
        plan = client.post("/v1/plans", json=spec, headers=bearer(OPERATOR_KEY))
        assert plan.status_code == 200, plan.text
        assert plan.json()["remaining_epsilon"] is None
        assert plan.json()["remaining_epsilon_after"] is None
        assert plan.json()["fits"] is False
        refused = client.post("/v1/jobs", json=spec, headers=bearer(OPERATOR_KEY))
        assert refused.status_code == 409, refused.text
        assert refused.json()["errors"][0]["field"] == "privacy.delta"
        assert client.get("/v1/datasets/1/budget", headers=bearer(OPERATOR_KEY)).json() == body
