"""The Alembic migrations build exactly the schema of the models, and undo it."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from service.db import Base, create_db_engine, upgrade
from service.db.engine import MIGRATIONS


def test_migrations_match_models(tmp_path):
    engine = create_db_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    upgrade(engine)  # a second start is a no-op
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert inspect(engine).get_table_names() == ["alembic_version"]
