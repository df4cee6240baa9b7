"""``dptune db``: the database schema — which revision it is at, and migrating it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from sqlalchemy import Engine

from service.db import create_db_engine, current_revision, head_revision
from service.db import upgrade as upgrade_schema
from service.settings import Settings, StartupError

app = typer.Typer(
    no_args_is_help=True,
    help="The database schema at DPTUNE_DATABASE_URL (default: SQLite in DPTUNE_STATE_DIR).",
)


@contextmanager
def _engine() -> Iterator[Engine]:
    """The service's database; a bad URL or an unreachable server is one line on stderr and
    exit status 1, as at ``dptune serve``."""
    settings = Settings()
    try:
        settings.prepare_dirs()
        engine = create_db_engine(settings.sqlalchemy_url)
        try:
            yield engine
        finally:
            engine.dispose()
    except StartupError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None


@app.command()
def upgrade() -> None:
    """Migrate the schema to the revision this version needs (stop the services running an
    older version first)."""
    with _engine() as engine:
        before, after = upgrade_schema(engine)
    if before == after:
        typer.echo(f"dptune: the database schema is at revision {after}, nothing to do")
    else:
        typer.echo(f"dptune: upgraded the database schema from {before or 'empty'} to {after}")


@app.command()
def current() -> None:
    """Print the schema's revision and whether it is the one this version needs (exit status
    0), or not (1)."""
    head = head_revision()
    with _engine() as engine:
        revision = current_revision(engine)
    if revision == head:
        typer.echo(f"{revision} (current)")
        return
    typer.echo(f"{revision or 'empty'} (this version needs {head})")
    raise typer.Exit(1)
