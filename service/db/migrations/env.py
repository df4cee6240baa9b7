"""Alembic environment. dptune runs the migrations itself (:mod:`service.db.schema`: at
start on an empty database, and ``dptune db upgrade``), passing its connection in
``config.attributes``; the ``alembic`` command line works too, with ``-x url=<database url>``."""

from alembic import context
from sqlalchemy import Connection, create_engine

from service.db.models import Base


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if url is None:
        raise SystemExit("give the database with: alembic -x url=<database url> ...")
    with create_engine(url).begin() as conn:
        _run(conn)
