"""every job written before the dataset's privacy filter counts as its curve

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28

A dataset's budget is a privacy filter (``core.accounting.filter``): route B of a row is what
the filter counts the job by, its route A or one (ε, δ) pair chosen at admission within a tenth
of the dataset's δ. Rows written before it carry, on route B, PLD and profile statements chosen
by the earlier rule (a PLD statement held the whole δ): recounted as their route A, so that the
dataset's total through the filter stays finite and later jobs are admitted by the filter on
top of them. The running sums' route B becomes a copy of their route A. Not undone by the
downgrade: route B as route A is a sound total for the earlier rule too.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    entry = sa.table(
        "ledger_entry", sa.column("pld_epsilon", sa.Float), sa.column("pld_delta", sa.Float)
    )
    bind = op.get_bind()
    bind.execute(entry.update().values(pld_epsilon=None, pld_delta=None))
    total = sa.table("ledger_total", sa.column("id", sa.Integer), sa.column("amount", sa.JSON))
    for row in bind.execute(sa.select(total.c.id, total.c.amount)).all():
        route_a = row.amount[: len(row.amount) // 2]
        bind.execute(total.update().where(total.c.id == row.id).values(amount=route_a + route_a))


def downgrade() -> None:
    """Nothing to undo: route B as route A is a sound total for the earlier rule too."""
