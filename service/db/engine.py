"""Engine set-up, migrations at start-up, and the lock that serialises budget changes.

SQLite: pysqlite's own transaction handling is disabled and we emit ``BEGIN`` ourselves
(SQLAlchemy docs, "Serializable isolation / Savepoints / Transactional DDL" for pysqlite), so
that a budget transaction can start with ``BEGIN IMMEDIATE``: it takes the database's write
lock *before* reading the ledger, so two admissions can never both read the same total.
PostgreSQL: the same transaction locks the dataset row with ``SELECT … FOR UPDATE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from service.db.models import Dataset

_IMMEDIATE = "dptune_sqlite_immediate"
MIGRATIONS = Path(__file__).parent / "migrations"


def create_db_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # no implicit BEGIN from pysqlite
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def begin_write(session: Session) -> None:
    """Begin the session's transaction as a writer. On SQLite that is ``BEGIN IMMEDIATE``: a
    deferred transaction that reads and then writes fails at once with "database is locked"
    when another process (a trial, the job driver) holds the write lock, instead of waiting.

    The lock is taken as a transaction begins, so a read-only transaction in progress is
    ended first; pending writes there would be a bug and raise.
    """
    if session.new or session.dirty or session.deleted:
        raise RuntimeError("begin_write: the session has unflushed changes")
    session.commit()
    session.connection(execution_options={_IMMEDIATE: True})


def locked_dataset(session: Session, dataset_id: int) -> Dataset | None:
    """Begin a write transaction holding the budget lock of a dataset and return it."""
    begin_write(session)
    query = select(Dataset).where(Dataset.id == dataset_id).with_for_update()
    return session.execute(query).scalar_one_or_none()


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest migration (``alembic upgrade head``)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
