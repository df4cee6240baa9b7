"""where each trial attempt ran

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

A trial attempt records the Ray node it ran on, so the operator can tell which node an attempt
that died was on. Attempts recorded before this revision have none.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trial_attempt") as batch:
        batch.add_column(sa.Column("node", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trial_attempt") as batch:
        batch.drop_column("node")
