"""The Alembic migrations build exactly the schema of the models, and undo it (on SQLite and
PostgreSQL)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Connection, Engine, inspect, select, text
from sqlalchemy.orm import Session

from core import accounting
from core.shapes import plan_shapes, shape_of
from service import ledger, visibility
from service.auth import Principal
from service.db import (
    Base,
    Dataset,
    Job,
    LedgerEntry,
    LedgerTotal,
    create_db_engine,
    head_revision,
    upgrade,
)
from service.db.schema import MIGRATIONS


def test_migrations_match_models(settings):
    engine = create_db_engine(settings.sqlalchemy_url)
    head = head_revision()
    assert upgrade(engine) == (None, head)
    assert upgrade(engine) == (head, head)  # a second run is a no-op
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert inspect(engine).get_table_names() == ["alembic_version"]
    assert upgrade(engine) == (None, head)  # and up again
    engine.dispose()


def _at_revision(settings, revision: str) -> Engine:
    """A fresh database migrated up to ``revision`` only."""
    engine = create_db_engine(settings.sqlalchemy_url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
    return engine


def _analyst_key(conn: Connection) -> None:
    conn.execute(
        text(
            "INSERT INTO api_key (id, name, role, secret_sha256, created_at) "
            "VALUES (1, 'ana', 'analyst', 'x', CURRENT_TIMESTAMP)"
        )
    )


def test_an_upgrade_keeps_every_row(settings):
    """Upgrading a database that holds data keeps all of it. On SQLite, Alembic's batch mode
    rebuilds a table (copy, drop, rename): with foreign keys enforced, dropping ``dataset``
    cascaded to the analysts' dataset scopes, or failed once a job referred to it."""
    engine = _at_revision(settings, "0001")
    with engine.begin() as conn:
        _analyst_key(conn)
        conn.execute(
            text(
                "INSERT INTO dataset (id, name, source, options, n, num_classes, input_shape, "
                "public_validation, epsilon, delta, created_at) VALUES (2, 'digits', "
                "'builtin:digits', '{}', 10, 3, '[4]', false, 1, 1e-5, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(text("INSERT INTO api_key_dataset VALUES (1, 2)"))
        conn.execute(
            text(
                "INSERT INTO job (id, dataset_id, owner_key_id, request_sha256, spec, plan, "
                "accounting, status, created_at) VALUES (1, 2, 1, 'x', '{}', '{}', 'rdp', "
                "'queued', CURRENT_TIMESTAMP)"
            )
        )
    assert upgrade(engine) == ("0001", head_revision())
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM dataset")).all() == [(2,)]
        assert conn.execute(text("SELECT * FROM api_key_dataset")).all() == [(1, 2)]
        assert conn.execute(text("SELECT id FROM job")).all() == [(1,)]
        if conn.dialect.name == "sqlite":  # enforced again on the pool's connections
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_the_upgrade_to_running_sums_fills_them_from_the_rows(settings):
    """Revision 0005 computes, from the ledger rows already there, the running sums that the
    service would have kept: the budget read from them is the all-rows budget, to the bit."""
    engine = _at_revision(settings, "0004")
    rng = np.random.default_rng(5)
    orders = len(accounting.ORDERS)
    rows, jobs = [], []
    for job in range(1, 9):
        jobs.append({"id": job, "dataset_id": 1 + job % 2})
        reserved = rng.uniform(0, 0.3, orders + 2)
        rows.append(("reservation", job, reserved))
        for _ in range(rng.integers(0, 4)):
            rows.append(("charge", job, reserved * rng.uniform(0, 0.5)))
        if job % 3:  # lost: the whole reservation charged, nothing outstanding
            rows.append(("charge", job, reserved))
        else:  # open, part of it released
            rows.append(("release", job, reserved * rng.uniform(0, 0.5)))
    rng.shuffle(rows)
    with engine.begin() as conn:
        _analyst_key(conn)
        for dataset in (1, 2):
            conn.execute(
                text(
                    "INSERT INTO dataset (id, name, source, options, n, num_classes, input_shape, "
                    "public_validation, epsilon, delta, content_sha256, created_at) VALUES "
                    f"({dataset}, 'd{dataset}', 'builtin:digits', '{{}}', 10, 3, '[4]', false, "
                    "100, 1e-3, '', CURRENT_TIMESTAMP)"
                )
            )
        for job in jobs:
            conn.execute(
                text(
                    "INSERT INTO job (id, dataset_id, owner_key_id, request_sha256, spec, plan, "
                    "accounting, status, created_at) VALUES (:id, :dataset_id, 1, 'x', '{}', "
                    "'{}', 'rdp', 'queued', CURRENT_TIMESTAMP)"
                ),
                job,
            )
        conn.execute(
            LedgerEntry.__table__.insert(),
            [
                {
                    "dataset_id": 1 + job % 2,
                    "job_id": job,
                    "reference": f"row:{i}",
                    "kind": kind,
                    "rdp": vec[:orders].tolist(),
                    "epsilon": float(vec[orders]),
                    "delta": float(vec[orders + 1]) / 1e5,  # within the pairs' share
                    "note": "",
                    "created_at": datetime.now(UTC),
                }
                for i, (kind, job, vec) in enumerate(rows)
            ],
        )
    assert upgrade(engine) == ("0004", head_revision())
    with Session(engine) as session:
        for dataset in session.execute(select(Dataset)).scalars():
            cached = ledger.budget(session, dataset)
            assert cached == ledger.budget_from_rows(session, dataset)
            assert 0 < cached.spent < cached.committed
        open_jobs = session.execute(select(LedgerTotal.job_id)).scalars().all()
        assert sorted(j for j in open_jobs if j is not None) == [3, 6]
    engine.dispose()


def test_the_upgrade_to_shapes_gives_an_old_plan_its_one_shape(settings):
    """Revision 0006: a job planned before shapes existed gets the one it ran with — the
    spec's batch size and epochs with the plan's q, T and σ — which is what the ledger charges
    its attempts by from then on."""
    engine = _at_revision(settings, "0005")
    spec = {"batch_size": 64, "epochs": 2}
    plan = {
        "sample_rate": 0.05,
        "steps": 40,
        "noise_multiplier": 1.5,
        "gradient_noise_multiplier": 1.6,
        "trial_epsilon": 0.9,
        "validation_noise": None,
    }
    with engine.begin() as conn:
        _analyst_key(conn)
        conn.execute(
            text(
                "INSERT INTO dataset (id, name, source, options, n, num_classes, input_shape, "
                "public_validation, epsilon, delta, content_sha256, created_at) VALUES "
                "(1, 'd', 'builtin:digits', '{}', 1280, 3, '[4]', false, 9, 1e-5, '', "
                "CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO job (id, dataset_id, owner_key_id, request_sha256, spec, plan, "
                "accounting, status, created_at) VALUES (1, 1, 1, 'x', :spec, :plan, 'rdp', "
                "'queued', CURRENT_TIMESTAMP)"
            ),
            {"spec": json.dumps(spec), "plan": json.dumps(plan)},
        )
    upgrade(engine)
    with Session(engine) as session:
        job = session.get(Job, 1)
        [shape] = plan_shapes(job.plan)
        assert shape_of([shape], {}) == shape
        assert (shape.batch_size, shape.epochs, shape.steps, shape.noise_multiplier) == (
            64,
            2.0,
            40,
            1.5,
        )
        expected = accounting.trial_rdp(0.05, 1.5, 40)
        assert np.array_equal(ledger.attempt_rdp(job, {}), expected)
    engine.dispose()


def test_the_upgrade_to_row_counts_counts_the_rows_already_there(settings):
    """Revision 0008: each dataset's row counts (all rows; the rows analysts do not see: those
    with no amount of random-stopping jobs) from the rows already there. Those rows have no ε
    of their own; they show the ε converted from their amount, as before."""
    engine = _at_revision(settings, "0007")
    orders = len(accounting.ORDERS)
    curve = np.linspace(0.01, 0.2, orders).tolist()
    rows = [  # (dataset, job, rdp, epsilon, delta)
        (1, 1, curve, 0.0, 0.0),
        (1, 2, None, 0.5, 1e-6),
        (1, 2, None, 0.0, 0.0),  # hidden: an lt job's zero row
        (1, 1, None, 0.0, 0.0),  # shown: an rdp job's zero row
        (2, 3, curve, 0.0, 0.0),
        (2, 3, None, 0.0, 0.0),  # hidden: a ps job's
    ]
    with engine.begin() as conn:
        _analyst_key(conn)
        for dataset in (1, 2, 3):
            conn.execute(
                text(
                    "INSERT INTO dataset (id, name, source, options, n, num_classes, input_shape, "
                    "public_validation, epsilon, delta, content_sha256, created_at) VALUES "
                    f"({dataset}, 'd{dataset}', 'builtin:digits', '{{}}', 10, 3, '[4]', false, "
                    "100, 1e-5, '', CURRENT_TIMESTAMP)"
                )
            )
        for job, dataset, kind in ((1, 1, "rdp"), (2, 1, "lt"), (3, 2, "ps")):
            conn.execute(
                text(
                    "INSERT INTO job (id, dataset_id, owner_key_id, request_sha256, spec, plan, "
                    f"accounting, status, created_at) VALUES ({job}, {dataset}, 1, 'x', '{{}}', "
                    f"'{{}}', '{kind}', 'queued', CURRENT_TIMESTAMP)"
                )
            )
        table = LedgerEntry.__table__
        for i, (dataset, job, rdp, epsilon, delta) in enumerate(rows):
            values = {"dataset_id": dataset, "job_id": job, "reference": f"row:{i}"}
            values |= {"kind": "charge", "rdp": rdp, "epsilon": epsilon, "delta": delta}
            conn.execute(table.insert().values(note="", created_at=datetime.now(UTC), **values))
    assert upgrade(engine) == ("0007", head_revision())
    with Session(engine) as session:
        counts = session.execute(
            select(Dataset.id, Dataset.ledger_rows, Dataset.ledger_rows_hidden).order_by(Dataset.id)
        ).all()
        assert counts == [(1, 4, 1), (2, 2, 1), (3, 0, 0)]
        entries = ledger.entries_of(session, 1) + ledger.entries_of(session, 2)
        assert [e.shown_epsilon for e in entries] == [None] * len(rows)
        for e in entries:
            curves = [np.array(e.rdp)] if e.rdp is not None else []
            want = accounting.charges_epsilon(curves, [(e.epsilon, e.delta)], 1e-5)
            assert ledger.entry_epsilon(e, 1e-5) == want
        assert ledger.entry_epsilon(entries[0], 1e-5) > 0
        operator = Principal(1, "operator", frozenset())
        dataset = session.get_one(Dataset, 1)
        views = visibility.ledger_entries(session, operator, dataset, ledger.rows_of(1))
        assert [v.epsilon for v in views] == [ledger.entry_epsilon(e, 1e-5) for e in entries[:4]]
    engine.dispose()


def test_the_upgrade_to_revocable_keys_marks_the_bootstrap_keys(settings):
    """Revision 0010: keys are valid; the operator keys named "bootstrap operator" (made by the
    service at start before keys were marked) are marked, so that a new DPTUNE_OPERATOR_KEY
    revokes them. On SQLite a deleted dataset's id is not given again."""
    engine = _at_revision(settings, "0009")
    keys = [  # (id, name, role)
        (1, "bootstrap operator", "operator"),
        (2, "bootstrap operator", "analyst"),
        (3, "ops", "operator"),
    ]
    with engine.begin() as conn:
        for key, name, role in keys:
            conn.execute(
                text(
                    "INSERT INTO api_key (id, name, role, secret_sha256, created_at) VALUES "
                    f"({key}, '{name}', '{role}', 'k{key}', CURRENT_TIMESTAMP)"
                )
            )
    assert upgrade(engine) == ("0009", head_revision())
    with engine.begin() as conn:
        marked = conn.execute(text("SELECT id, bootstrap, revoked_at FROM api_key ORDER BY id"))
        assert marked.all() == [(1, True, None), (2, False, None), (3, False, None)]
        for _ in range(2):
            conn.execute(
                text(
                    "INSERT INTO dataset (name, source, options, n, num_classes, input_shape, "
                    "public_validation, epsilon, delta, content_sha256, created_at) VALUES "
                    "('d', 'builtin:digits', '{}', 10, 3, '[4]', false, 1, 1e-5, '', "
                    "CURRENT_TIMESTAMP) "
                )
            )
            last = conn.execute(text("SELECT max(id) FROM dataset")).scalar()
            conn.execute(text(f"DELETE FROM dataset WHERE id = {last}"))
        assert last == 2
    engine.dispose()
