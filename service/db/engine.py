"""Engine set-up and the lock that serialises budget changes.

SQLite: pysqlite's own transaction handling is disabled and we emit ``BEGIN`` ourselves
(SQLAlchemy docs, "Serializable isolation / Savepoints / Transactional DDL" for pysqlite), so
that a budget transaction can start with ``BEGIN IMMEDIATE``: it takes the database's write
lock *before* reading the ledger, so two admissions can never both read the same total.
PostgreSQL: the same transaction locks the dataset row with ``SELECT … FOR UPDATE``.

On SQLite the write transactions of one process also queue on a lock of their engine before
``BEGIN IMMEDIATE``, and let go of it once their COMMIT or ROLLBACK has run in SQLite
(:class:`_SQLiteConnection`), so that at most one of them waits in SQLite's busy handler.
That handler polls with growing sleeps, first come is not first served, and with a hundred
writers in flight one could wait out the busy timeout and fail with "database is locked"
(HTTP 500). Writers in other processes still meet the busy timeout.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from sqlalchemy import URL, Engine, create_engine, event, make_url, select
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

from service.db.models import Dataset
from service.settings import StartupError

IMMEDIATE = "dptune_sqlite_immediate"
"""Execution option: on SQLite, a transaction on this connection begins ``IMMEDIATE``."""

POOL_SIZE = 40
"""Connections per process, and requests the API serves at once (``service.api.limits.InFlight``):
each request holds at most one, so none waits for a connection. Under load, SQLAlchemy's default
pool (5 + 10) runs dry — requests queued on the budget lock hold the connections — and requests
fail after its pool timeout (HTTP 500), some after their job was admitted
(bench/service_load.py). 40 is also anyio's default number of worker threads."""
POOL = {"pool_size": POOL_SIZE, "max_overflow": 10}  # overflow: the poller, health checks

SQLITE_TIMEOUT_S = 60.0
"""How long a SQLite connection waits for another's lock (its busy timeout), and for a new
database's switch to WAL (:func:`_journal_wal`)."""


def create_db_engine(url: str) -> Engine:
    """The engine for ``DPTUNE_DATABASE_URL``; a URL that is malformed or names a dialect or
    driver that is not installed is a :class:`StartupError` that never shows the password."""
    parsed = _parse(url)
    try:
        return _create(parsed)
    except (ArgumentError, ImportError) as err:
        raise StartupError(
            f"dptune: cannot use DPTUNE_DATABASE_URL={redact(parsed)}: {scrub(str(err), parsed)}"
            " (PostgreSQL needs pip install 'dptune[postgres]')"
        ) from None


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except (ArgumentError, ValueError):
        # the error text quotes the URL, password included: say nothing more than this
        raise StartupError(
            "dptune: DPTUNE_DATABASE_URL is not a database URL "
            "(postgresql+psycopg://user:password@host:5432/dbname or sqlite:///path/dptune.db)"
        ) from None


_decoder = msgspec.json.Decoder()


def json_loads(text: str | bytes) -> Any:
    """How JSON columns are read. A ledger row's curve is ~150 floats, and with the stdlib
    parser decoding the 100 rows a budget read shows and the running sums is most of the read.
    msgspec parses them several times faster, and exactly: each number becomes the
    float nearest to it, an integer of any size the same integer, as with :func:`json.loads`
    (tests/service/test_read_path.py). What is not strict JSON, such as the ``NaN`` and
    ``Infinity`` that :func:`json.dumps` writes, msgspec refuses; :func:`json.loads` reads it."""
    try:
        return _decoder.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


class _SQLiteConnection(sqlite3.Connection):
    """A SQLite connection that lets go of its engine's writer lock once its transaction has
    ended in SQLite. SQLAlchemy's commit and rollback events come before the driver's COMMIT
    or ROLLBACK: a writer let in at the event met SQLite's write lock still held, and waited
    for it in SQLite's busy handler."""

    writer: threading.Lock  # the engine's, set as the connection is made
    holds_writer = False

    def commit(self) -> None:
        with self._ending():
            super().commit()

    def rollback(self) -> None:
        with self._ending():
            super().rollback()

    def close(self) -> None:
        with self._ending():
            super().close()

    @contextlib.contextmanager
    def _ending(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.release_writer()

    def release_writer(self) -> None:
        if self.holds_writer:
            self.holds_writer = False
            self.writer.release()


def _create(url: URL) -> Engine:
    options: dict[str, Any] = {"json_deserializer": json_loads, **POOL}
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, **options)
    connect_args = {
        "timeout": SQLITE_TIMEOUT_S,
        "check_same_thread": False,
        "factory": _SQLiteConnection,
    }
    engine = create_engine(url, connect_args=connect_args, **options)
    writer = threading.Lock()

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: _SQLiteConnection, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # no implicit BEGIN from pysqlite
        dbapi_connection.writer = writer
        dbapi_connection.execute("PRAGMA foreign_keys=ON")
        _journal_wal(dbapi_connection)  # readers do not wait for the writer

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        if not connection.get_execution_options().get(IMMEDIATE, False):
            connection.exec_driver_sql("BEGIN")
            return
        dbapi_connection = connection.connection.dbapi_connection
        if not dbapi_connection.holds_writer:  # else kept from a transaction that ended unseen
            writer.acquire()
            dbapi_connection.holds_writer = True
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            dbapi_connection.release_writer()
            raise

    @event.listens_for(engine.pool, "checkin")
    def _on_checkin(dbapi_connection: _SQLiteConnection | None, _record: Any) -> None:
        if dbapi_connection is not None:  # None: invalidated, and so closed
            dbapi_connection.release_writer()

    return engine


def _journal_wal(dbapi_connection: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode=WAL``, retried while the database is locked. Switching a database
    that is not in WAL mode yet (a new one) takes its write lock, and while another connection
    holds that lock SQLite answers "database is locked" at once, without waiting its busy
    timeout, so of two services starting together on a new database one would fail
    (``tests/service/test_schema.py`` holds the lock and checks the wait)."""
    deadline = time.monotonic() + SQLITE_TIMEOUT_S
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def redact(url: URL) -> str:
    """The URL as an operator may see it in a message or a log: the password as ``***``."""
    return url.render_as_string(hide_password=True)


def scrub(text: str, url: URL) -> str:
    """A driver's error message on one line, with the URL's password (should it quote it)
    replaced by ``***``."""
    line = " ".join(text.split())
    return line.replace(url.password, "***") if url.password else line


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
    session.connection(execution_options={IMMEDIATE: True})


def locked_dataset(session: Session, dataset_id: int) -> Dataset | None:
    """Begin a write transaction holding the budget lock of a dataset and return it."""
    begin_write(session)
    query = select(Dataset).where(Dataset.id == dataset_id).with_for_update()
    return session.execute(query).scalar_one_or_none()
