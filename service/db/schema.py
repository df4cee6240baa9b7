"""The schema belongs to Alembic: the migrations in ``migrations/`` are the only thing that
creates or changes it.

At start the service (:func:`ensure_schema`) runs them on an empty database, so the embedded
default needs no step. A database at an older revision it refuses, unless
``DPTUNE_AUTO_UPGRADE`` says otherwise: a migration cannot be undone once the new version has
written rows, and another service still running the old version may share the database, so
changing the schema is the operator's decision (``dptune db upgrade``). A database it cannot
read (a newer revision, or tables that are not dptune's) it never touches.

Services starting together against one database migrate it once: the revision is read and the
migrations run in one transaction holding a lock (PostgreSQL: an advisory lock; SQLite:
``BEGIN IMMEDIATE``), so whoever comes second finds the schema at head.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from service.db.engine import IMMEDIATE, redact, scrub
from service.settings import StartupError

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
_LOCK_KEY = 0x64707475  # PostgreSQL advisory lock of schema changes ("dptu")


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    """The migrations, read once: they are this version's own files (each read imports every
    migration module again)."""
    return ScriptDirectory.from_config(_config())


def head_revision() -> str:
    """The revision this version of dptune needs: the newest migration."""
    head = _scripts().get_current_head()
    assert head is not None, "no migrations"
    return head


def current_revision(engine: Engine) -> str | None:
    """The database's revision; None for a database without one (empty, or not dptune's)."""
    with _connect(engine) as connection:
        return MigrationContext.configure(connection).get_current_revision()


def ensure_schema(engine: Engine, auto_upgrade: bool = False) -> None:
    """Create an empty database's schema; refuse (:class:`StartupError`) one at an older
    revision unless ``auto_upgrade``, and one at a revision this version does not know."""
    head = head_revision()
    with _locked(engine) as connection:
        current = _known_revision(connection, head)
        if current == head:
            return
        if current is not None and not auto_upgrade:
            raise StartupError(
                f"dptune: the database schema is at revision {current}, this version needs "
                f"{head}: run 'dptune db upgrade' (or set DPTUNE_AUTO_UPGRADE=1)"
            )
        _migrate(connection)
    if current is not None:
        log.warning("upgraded the database schema from revision %s to %s", current, head)


def upgrade(engine: Engine) -> tuple[str | None, str]:
    """Bring the schema to the newest migration (``dptune db upgrade``); returns the
    revisions before and after (None: the database was empty)."""
    head = head_revision()
    with _locked(engine) as connection:
        current = _known_revision(connection, head)
        if current != head:
            _migrate(connection)
    return current, head


def _known_revision(connection: Connection, head: str) -> str | None:
    """The database's revision, which this version has a migration for; None: empty (or
    migrated down to nothing)."""
    current = MigrationContext.configure(connection).get_current_revision()
    if current is None:
        if set(inspect(connection).get_table_names()) - {"alembic_version"}:
            raise StartupError(
                f"dptune: the database DPTUNE_DATABASE_URL={redact(connection.engine.url)} has "
                "tables but no dptune schema revision: point it at an empty database or one "
                "dptune created"
            )
        return None
    known = {script.revision for script in _scripts().walk_revisions()}
    if current not in known:
        raise StartupError(
            f"dptune: the database schema is at revision {current}, which this version does "
            f"not know (it needs {head}): run the dptune version that wrote it"
        )
    return current


def _migrate(connection: Connection) -> None:
    config = _config()
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


@contextmanager
def _connect(engine: Engine) -> Iterator[Connection]:
    try:
        connection = engine.connect()
    except DBAPIError as err:
        raise StartupError(
            f"dptune: cannot connect to the database DPTUNE_DATABASE_URL={redact(engine.url)}: "
            f"{scrub(str(err.orig), engine.url)}"
        ) from None
    with connection:
        yield connection


@contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the lock of schema changes until it ends."""
    with _connect(engine) as connection, _sqlite_foreign_keys_off(connection):
        connection = connection.execution_options(**{IMMEDIATE: True})
        with connection.begin():
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
            yield connection
            if connection.dialect.name == "sqlite":
                _check_foreign_keys(connection)


@contextmanager
def _sqlite_foreign_keys_off(connection: Connection) -> Iterator[None]:
    """On SQLite, Alembic's batch mode changes a table by copying it, dropping the old one and
    renaming the copy. With foreign keys enforced, the drop deletes the rows that refer to it
    (``ON DELETE CASCADE``: analysts' dataset scopes) or fails (jobs). SQLite's documented
    procedure (https://sqlite.org/lang_altertable.html, "Making Other Kinds Of Table Schema
    Changes") turns enforcement off outside the transaction and checks the keys at its end.
    The pragma is a no-op inside a transaction, so it is sent on the driver's connection
    before the migration's transaction begins."""
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
    try:
        yield
    finally:
        if sqlite:
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]


def _check_foreign_keys(connection: Connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        raise RuntimeError(f"the migration broke foreign keys: {broken[:5]}")
