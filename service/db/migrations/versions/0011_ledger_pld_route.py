"""a ledger row's second route: the PLD statement of its job

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28

A fixed-K job is also stated by the PLD of its composition, and a ps job by its privacy-profile
bound: one (ε, δ) pair for the whole job. The ledger composes a second route in which a row
that carries such a pair counts as that pair instead of its curve and (ε, δ), and the dataset's
total is the smaller of the two routes (``service.ledger``). A row's pair is ``pld_epsilon``
and ``pld_delta``; empty, the row counts the same on both routes. Rows written before this
revision are empty, and the running sums (``ledger_total.amount``) gain the second route as a
copy of the first: the totals stay what they were.
"""

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def _totals() -> sa.TableClause:
    return sa.table("ledger_total", sa.column("id", sa.Integer), sa.column("amount", sa.JSON))


def _rewrite(change: Callable[[list[Any]], list[Any]]) -> None:
    """Each running sum's parts (lists of floats), changed."""
    total = _totals()
    bind = op.get_bind()
    for row in bind.execute(sa.select(total.c.id, total.c.amount)).all():
        bind.execute(total.update().where(total.c.id == row.id).values(amount=change(row.amount)))


def upgrade() -> None:
    with op.batch_alter_table("ledger_entry") as batch:
        batch.add_column(sa.Column("pld_epsilon", sa.Float(), nullable=True))
        batch.add_column(sa.Column("pld_delta", sa.Float(), nullable=True))
    _rewrite(lambda amount: amount + amount)


def downgrade() -> None:
    """Back to the first route alone (today's ledger before this revision: a sound total)."""
    _rewrite(lambda amount: amount[: len(amount) // 2])
    with op.batch_alter_table("ledger_entry") as batch:
        batch.drop_column("pld_delta")
        batch.drop_column("pld_epsilon")
