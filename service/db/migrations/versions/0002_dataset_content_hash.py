"""dataset content hash

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Datasets registered before this revision get a hash no data has (all zeros): trials refuse
them until the operator registers the data again, rather than training on data whose size
may have changed since its privacy cost was planned.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dataset") as batch:
        batch.add_column(
            sa.Column("content_sha256", sa.String(64), nullable=False, server_default="0" * 64)
        )
    with op.batch_alter_table("dataset") as batch:
        batch.alter_column("content_sha256", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("dataset") as batch:
        batch.drop_column("content_sha256")
