"""a dataset's ledger rows indexed in id order

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24

A budget read lists a dataset's newest ledger rows, and the ledger endpoint pages through them
after a row id. With an index on ``dataset_id`` alone, PostgreSQL read all the dataset's rows
and sorted them to return the newest: about 6 ms at 2,000 rows, growing with the ledger. An
index on ``(dataset_id, id)`` hands them over in order, so a read touches only the rows it
returns; it also serves every lookup by ``dataset_id``, so it replaces that index.
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_ledger_entry_dataset_id_id", "ledger_entry", ["dataset_id", "id"], unique=False
    )
    op.drop_index("ix_ledger_entry_dataset_id", table_name="ledger_entry")


def downgrade() -> None:
    op.create_index("ix_ledger_entry_dataset_id", "ledger_entry", ["dataset_id"], unique=False)
    op.drop_index("ix_ledger_entry_dataset_id_id", table_name="ledger_entry")
