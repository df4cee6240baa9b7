"""The Alembic migrations build exactly the schema of the models, and undo it (on SQLite and
PostgreSQL)."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from service.db import Base, create_db_engine, head_revision, upgrade
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


def test_an_upgrade_keeps_every_row(settings):
    """Upgrading a database that holds data keeps all of it. On SQLite, Alembic's batch mode
    rebuilds a table (copy, drop, rename): with foreign keys enforced, dropping ``dataset``
    cascaded to the analysts' dataset scopes, or failed once a job referred to it."""
    engine = create_db_engine(settings.sqlalchemy_url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO api_key (id, name, role, secret_sha256, created_at) "
                "VALUES (1, 'ana', 'analyst', 'x', CURRENT_TIMESTAMP)"
            )
        )
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
