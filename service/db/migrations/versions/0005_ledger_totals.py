"""running sums of the ledger

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

``ledger_total`` keeps, per dataset, the exact sum of its charge rows and each open job's
outstanding reservation, so that a budget read does not compose every ledger row
(service/ledger.py). The upgrade fills it from the rows already there, with the same exact
arithmetic (each float as a fraction, summed exactly), and stores each part as floats whose
exact sum it is.
"""

from collections import defaultdict
from fractions import Fraction

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ORDERS = 156  # len(core.accounting.ORDERS) when this revision was written


def upgrade() -> None:
    total = op.create_table(
        "ledger_total",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("amount", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["dataset.id"], name=op.f("fk_ledger_total_dataset_id_dataset")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_ledger_total_job_id_job")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_total")),
        sa.UniqueConstraint("job_id", name=op.f("uq_ledger_total_job_id")),
    )
    op.create_index(
        op.f("ix_ledger_total_dataset_id"), "ledger_total", ["dataset_id"], unique=False
    )
    op.bulk_insert(total, _totals())


def _totals() -> list[dict]:
    """Per dataset the sum of its charges, per job its outstanding reservation
    max(0, reserved − charged − released), part by part (RDP orders, ε, δ), exactly."""
    entry = sa.table(
        "ledger_entry",
        sa.column("id", sa.Integer),
        sa.column("dataset_id", sa.Integer),
        sa.column("job_id", sa.Integer),
        sa.column("kind", sa.String),
        sa.column("rdp", sa.JSON),
        sa.column("epsilon", sa.Float),
        sa.column("delta", sa.Float),
    )
    zero = [Fraction(0)] * (ORDERS + 2)
    charges: dict[int, list[Fraction]] = defaultdict(lambda: zero)
    signed: dict[tuple[int, int], list[Fraction]] = defaultdict(lambda: zero)
    rows = op.get_bind().execute(sa.select(entry).order_by(entry.c.id))
    for row in rows:
        vec = [Fraction(x) for x in [*(row.rdp or [0.0] * ORDERS), row.epsilon, row.delta]]
        if row.kind == "charge":
            before = charges[row.dataset_id]
            charges[row.dataset_id] = [a + b for a, b in zip(before, vec, strict=True)]
        sign = 1 if row.kind == "reservation" else -1
        key = (row.dataset_id, row.job_id)
        signed[key] = [a + sign * b for a, b in zip(signed[key], vec, strict=True)]
    out = [{"dataset_id": d, "job_id": None, "amount": _dump(v)} for d, v in charges.items()]
    for (dataset_id, job_id), vec in signed.items():
        left = [max(Fraction(0), x) for x in vec]
        if any(left) and job_id is not None:
            out.append({"dataset_id": dataset_id, "job_id": job_id, "amount": _dump(left)})
    return out


def _dump(vec: list[Fraction]) -> list[list[float]]:
    """Each part as floats whose exact sum it is, largest first (service.ledger's form)."""
    parts = []
    for x in vec:
        floats = []
        while x:
            floats.append(float(x))  # correctly rounded
            x -= Fraction(floats[-1])
        parts.append(floats)
    return parts


def downgrade() -> None:
    op.drop_index(op.f("ix_ledger_total_dataset_id"), table_name="ledger_total")
    op.drop_table("ledger_total")
