"""job runner token

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

A job's runner reports to the control plane's internal API with a token minted at submission;
only its SHA-256 is stored. Jobs submitted before this revision have none, so their runners
(which talked to the database directly) cannot report: reconciliation settles them.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("runner_token_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("runner_token_sha256")
