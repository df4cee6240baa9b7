"""Alembic is the only way the schema is made: the service creates an empty database's schema
at start, refuses an outdated one (one line naming the command) unless DPTUNE_AUTO_UPGRADE,
refuses one it does not know, and ``dptune db upgrade`` / ``current`` migrate and report."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.config import Config
from fastapi.testclient import TestClient
from sqlalchemy import Engine, inspect, make_url, text
from typer.testing import CliRunner

from service.api import create_app
from service.cli import app as cli
from service.db import create_db_engine, current_revision, head_revision
from service.db.schema import MIGRATIONS
from service.settings import Settings, StartupError

OUTDATED = "0002"
REPLICAS = 2
# a service's start as a process of its own: wait for the others, then ensure the schema
_START = """
import pathlib, sys, time
from service.db import create_db_engine, ensure_schema
url, ready, me, replicas = sys.argv[1:]
engine = create_db_engine(url)
(pathlib.Path(ready) / me).touch()
while len(list(pathlib.Path(ready).iterdir())) < int(replicas):
    time.sleep(0.01)
ensure_schema(engine)
"""


def _migrate_to(engine: Engine, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def _columns(engine: Engine) -> dict[str, list[str]]:
    schema = inspect(engine)
    return {t: [c["name"] for c in schema.get_columns(t)] for t in schema.get_table_names()}


def _start(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200


@pytest.fixture
def engine(settings) -> Iterator[Engine]:
    engine = create_db_engine(settings.sqlalchemy_url)
    yield engine
    engine.dispose()


def test_an_empty_database_is_created_at_head(settings, engine):
    assert current_revision(engine) is None
    _start(settings)
    assert current_revision(engine) == head_revision()
    _start(settings)  # and a second start finds it current


def test_an_outdated_database_is_refused_with_the_command_to_run(settings, engine):
    _migrate_to(engine, OUTDATED)
    before = _columns(engine)
    with pytest.raises(StartupError) as refused:
        _start(settings)
    assert str(refused.value) == (
        f"dptune: the database schema is at revision {OUTDATED}, this version needs "
        f"{head_revision()}: run 'dptune db upgrade' (or set DPTUNE_AUTO_UPGRADE=1)"
    )
    assert current_revision(engine) == OUTDATED
    assert _columns(engine) == before


def test_auto_upgrade_migrates_an_outdated_database(settings, engine, monkeypatch):
    _migrate_to(engine, OUTDATED)
    monkeypatch.setenv("DPTUNE_AUTO_UPGRADE", "1")
    _start(Settings(data_dir=settings.data_dir, database_url=settings.database_url))
    assert current_revision(engine) == head_revision()


def test_a_newer_database_is_never_touched(settings, engine):
    _migrate_to(engine, "head")
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(StartupError, match="at revision 9999, which this version does not know"):
        _start(settings.model_copy(update={"auto_upgrade": True}))
    assert current_revision(engine) == "9999"


def test_a_database_with_tables_but_no_revision_is_never_touched(settings, engine):
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE someone_elses (id INTEGER PRIMARY KEY)"))
    with pytest.raises(StartupError, match="has tables but no dptune schema revision"):
        _start(settings)
    assert inspect(engine).get_table_names() == ["someone_elses"]


def test_services_starting_together_migrate_once(settings, tmp_path):
    """Replicas started at once against an empty database: one creates the schema, the
    others wait for it and find it current (without the lock, CREATE TABLE collides)."""
    ready = tmp_path / "ready"
    ready.mkdir()
    starts = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _START,
                settings.sqlalchemy_url,
                str(ready),
                str(i),
                str(REPLICAS),
            ]
        )
        for i in range(REPLICAS)
    ]
    assert [p.wait(timeout=120) for p in starts] == [0] * REPLICAS
    engine = create_db_engine(settings.sqlalchemy_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_a_connection_to_a_new_sqlite_database_waits_for_its_write_lock(tmp_path):
    """Switching a database to WAL takes its write lock, and SQLite answers "database is
    locked" at once, without waiting its busy timeout, while another connection holds it
    (one of two services starting together on a new database failed so): the connection
    waits for the lock instead."""
    path = tmp_path / "new.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE seed (x INTEGER)")  # a database not in WAL mode yet
    holder.execute("BEGIN IMMEDIATE")  # its write lock, held for a moment
    release = threading.Timer(0.3, holder.execute, ["COMMIT"])
    release.start()
    engine = create_db_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        release.join()
        engine.dispose()
        holder.close()


def test_db_commands(settings, engine, monkeypatch):
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(settings.data_dir))
    if settings.database_url:
        monkeypatch.setenv("DPTUNE_DATABASE_URL", settings.database_url)
    runner = CliRunner()
    head = head_revision()

    result = runner.invoke(cli, ["db", "current"])
    assert (result.exit_code, result.output) == (1, f"empty (this version needs {head})\n")
    _migrate_to(engine, OUTDATED)
    result = runner.invoke(cli, ["db", "current"])
    assert (result.exit_code, result.output) == (1, f"{OUTDATED} (this version needs {head})\n")

    result = runner.invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 0
    assert result.output == f"dptune: upgraded the database schema from {OUTDATED} to {head}\n"
    assert current_revision(engine) == head
    result = runner.invoke(cli, ["db", "current"])
    assert (result.exit_code, result.output) == (0, f"{head} (current)\n")
    result = runner.invoke(cli, ["db", "upgrade"])
    assert result.output == f"dptune: the database schema is at revision {head}, nothing to do\n"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+psycopg://dptune:hunter2@127.0.0.1:1/dptune", "Connection refused"),
        ("postgresql+psycopg://dptune:hunter2@db:port/dptune", "is not a database URL"),
        ("nosuchdb://dptune:hunter2@db/dptune", "Can't load plugin"),
        ("sqlite:////nonexistent/dptune.db", "unable to open database file"),
        ("wrong password", "password authentication failed"),
    ],
)
def test_a_database_that_cannot_be_used_names_the_setting(url, says, tmp_path, request):
    if url == "wrong password":
        server = make_url(request.getfixturevalue("postgres_server"))
        url = server.set(password="hunter2").render_as_string(hide_password=False)
    with pytest.raises(StartupError) as refused:
        _start(Settings(data_dir=tmp_path, database_url=url))
    message = str(refused.value)
    assert "DPTUNE_DATABASE_URL" in message and says in message
    assert "hunter2" not in message and "\n" not in message

    env = {"DPTUNE_DATABASE_URL": url, "DPTUNE_DATA_DIR": str(tmp_path)}
    result = CliRunner().invoke(cli, ["db", "upgrade"], env=env)
    assert result.exit_code == 1 and "hunter2" not in result.output
    assert result.output.count("\n") == 1 and "DPTUNE_DATABASE_URL" in result.output
