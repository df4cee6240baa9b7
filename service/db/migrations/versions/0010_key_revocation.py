"""revocable keys; the bootstrap operator key marked; dataset ids never reused

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28

An operator revokes a key (``DELETE /v1/keys/{id}``): its row stays, with the time, since the
jobs and ledger rows it made name it, and it authenticates no more. The key the service made
at start (``DPTUNE_OPERATOR_KEY``, or the one it printed) is marked, so that a new
``DPTUNE_OPERATOR_KEY`` revokes the one it replaces (``service.auth.bootstrap_operator``).
Before this revision such keys were told apart only by their name: the operator keys named
"bootstrap operator" are marked.

An operator deletes a dataset never charged (``DELETE /v1/datasets/{id}``). SQLite would give
the next dataset the id of the last one deleted; AUTOINCREMENT makes it a new id, as
PostgreSQL's sequence does, so that an id never names two datasets.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_key") as batch:
        batch.add_column(
            sa.Column("bootstrap", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    key = sa.table(
        "api_key", sa.column("name"), sa.column("role"), sa.column("bootstrap", sa.Boolean())
    )
    op.execute(
        key.update()
        .where(key.c.name == "bootstrap operator", key.c.role == "operator")
        .values(bootstrap=True)
    )
    _sqlite_autoincrement(True)


def downgrade() -> None:
    _sqlite_autoincrement(False)
    with op.batch_alter_table("api_key") as batch:
        batch.drop_column("revoked_at")
        batch.drop_column("bootstrap")


def _sqlite_autoincrement(on: bool) -> None:
    """Copy the dataset table (SQLite only) with or without AUTOINCREMENT."""
    if op.get_bind().dialect.name == "sqlite":
        options = {"sqlite_autoincrement": on}
        with op.batch_alter_table("dataset", recreate="always", table_kwargs=options):
            pass
