"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_key",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_key")),
        sa.UniqueConstraint("secret_sha256", name=op.f("uq_api_key_secret_sha256")),
    )
    op.create_table(
        "dataset",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("source", sa.String(length=300), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("num_classes", sa.Integer(), nullable=False),
        sa.Column("input_shape", sa.JSON(), nullable=False),
        sa.Column("public_validation", sa.Boolean(), nullable=False),
        sa.Column("epsilon", sa.Float(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dataset")),
        sa.UniqueConstraint("name", name=op.f("uq_dataset_name")),
    )
    op.create_table(
        "api_key_dataset",
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_key.id"],
            name=op.f("fk_api_key_dataset_api_key_id_api_key"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["dataset.id"],
            name=op.f("fk_api_key_dataset_dataset_id_dataset"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("api_key_id", "dataset_id", name=op.f("pk_api_key_dataset")),
    )
    op.create_table(
        "job",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("owner_key_id", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("request_sha256", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("accounting", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["dataset.id"], name=op.f("fk_job_dataset_id_dataset")
        ),
        sa.ForeignKeyConstraint(
            ["owner_key_id"], ["api_key.id"], name=op.f("fk_job_owner_key_id_api_key")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job")),
        sa.UniqueConstraint("owner_key_id", "idempotency_key", name=op.f("uq_job_owner_key_id")),
    )
    op.create_index(op.f("ix_job_dataset_id"), "job", ["dataset_id"], unique=False)
    op.create_table(
        "ledger_entry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("reference", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("rdp", sa.JSON(), nullable=True),
        sa.Column("epsilon", sa.Float(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("note", sa.String(length=300), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["dataset.id"], name=op.f("fk_ledger_entry_dataset_id_dataset")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_ledger_entry_job_id_job")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_entry")),
        sa.UniqueConstraint("reference", name=op.f("uq_ledger_entry_reference")),
    )
    op.create_index(
        op.f("ix_ledger_entry_dataset_id"), "ledger_entry", ["dataset_id"], unique=False
    )
    op.create_index(op.f("ix_ledger_entry_job_id"), "ledger_entry", ["job_id"], unique=False)
    op.create_table(
        "trial",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("thresholds", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_trial_job_id_job")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trial")),
        sa.UniqueConstraint("job_id", "index", name=op.f("uq_trial_job_id")),
    )
    op.create_index(op.f("ix_trial_job_id"), "trial", ["job_id"], unique=False)
    op.create_table(
        "artifact",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=300), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_artifact_job_id_job")),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trial.id"], name=op.f("fk_artifact_trial_id_trial")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifact")),
        sa.UniqueConstraint("job_id", name=op.f("uq_artifact_job_id")),
    )
    op.create_table(
        "trial_attempt",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trial.id"], name=op.f("fk_trial_attempt_trial_id_trial")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trial_attempt")),
        sa.UniqueConstraint("trial_id", "number", name=op.f("uq_trial_attempt_trial_id")),
    )
    op.create_index(op.f("ix_trial_attempt_trial_id"), "trial_attempt", ["trial_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_trial_attempt_trial_id"), table_name="trial_attempt")
    op.drop_table("trial_attempt")
    op.drop_table("artifact")
    op.drop_index(op.f("ix_trial_job_id"), table_name="trial")
    op.drop_table("trial")
    op.drop_index(op.f("ix_ledger_entry_job_id"), table_name="ledger_entry")
    op.drop_index(op.f("ix_ledger_entry_dataset_id"), table_name="ledger_entry")
    op.drop_table("ledger_entry")
    op.drop_index(op.f("ix_job_dataset_id"), table_name="job")
    op.drop_table("job")
    op.drop_table("api_key_dataset")
    op.drop_table("dataset")
    op.drop_table("api_key")
