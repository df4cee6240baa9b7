"""ledger row counts per dataset, each row's ε as shown

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24

A budget read lists the newest ledger rows and says how many the caller sees in all. Counting
them read every row of the dataset, and showing a row read its RDP curve (~3 KB) to convert
it. Now the dataset keeps its row counts (all rows; rows hidden from analysts: those with no
amount of random-stopping jobs), and a row written from now on keeps its own ε at the dataset's
δ (which never changes). The upgrade counts the rows already there; their ε stays empty and is
computed from their curve when shown, as before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

RANDOM_STOPPING = ("lt", "ps")  # core.accounting.RANDOM_STOPPING when this revision was written


def upgrade() -> None:
    with op.batch_alter_table("dataset") as batch:
        for name in ("ledger_rows", "ledger_rows_hidden"):
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("ledger_entry") as batch:
        batch.add_column(sa.Column("shown_epsilon", sa.Float(), nullable=True))
    dataset, entry, job = _tables()
    rows = sa.select(sa.func.count()).where(entry.c.dataset_id == dataset.c.id)
    hidden = rows.where(
        entry.c.job_id.in_(sa.select(job.c.id).where(job.c.accounting.in_(RANDOM_STOPPING))),
        entry.c.epsilon == 0,
        entry.c.delta == 0,
        sa.or_(entry.c.rdp.is_(None), sa.cast(entry.c.rdp, sa.String) == "null"),
    )
    op.execute(
        dataset.update().values(
            ledger_rows=rows.scalar_subquery(), ledger_rows_hidden=hidden.scalar_subquery()
        )
    )


def _tables() -> tuple[sa.TableClause, sa.TableClause, sa.TableClause]:
    dataset = sa.table(
        "dataset",
        sa.column("id", sa.Integer),
        sa.column("ledger_rows", sa.Integer),
        sa.column("ledger_rows_hidden", sa.Integer),
    )
    entry = sa.table(
        "ledger_entry",
        sa.column("dataset_id", sa.Integer),
        sa.column("job_id", sa.Integer),
        sa.column("rdp", sa.JSON),
        sa.column("epsilon", sa.Float),
        sa.column("delta", sa.Float),
    )
    job = sa.table("job", sa.column("id", sa.Integer), sa.column("accounting", sa.String))
    return dataset, entry, job


def downgrade() -> None:
    with op.batch_alter_table("ledger_entry") as batch:
        batch.drop_column("shown_epsilon")
    with op.batch_alter_table("dataset") as batch:
        batch.drop_column("ledger_rows_hidden")
        batch.drop_column("ledger_rows")
