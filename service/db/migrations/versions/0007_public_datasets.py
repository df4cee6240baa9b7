"""public datasets, searched on as proxies

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

The operator may register a dataset as public. Jobs on a private dataset may then tune on it
(``proxy``): the search runs on the public data and costs nothing, and only the chosen
candidate trains on the private data. Datasets registered before are private.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dataset") as batch:
        batch.add_column(
            sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("dataset") as batch:
        batch.drop_column("public")
