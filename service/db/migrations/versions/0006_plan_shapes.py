"""plans list their trial shapes

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

A job's plan now lists each (batch_size, epochs) its trials may run with, and the q, T and σ
the planner gave it (``Plan.shapes``, :mod:`core.shapes`): the ledger, the runner and the
views read a trial's privacy from there. A job planned before had one shape, the spec's own
batch size and epochs with the plan's q, T and σ; this revision writes it into the plan.
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

JOB = sa.table(
    "job", sa.column("id", sa.Integer), sa.column("spec", sa.JSON), sa.column("plan", sa.JSON)
)


def _shape(spec: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "batch_size": spec["batch_size"],
        "epochs": float(spec["epochs"]),
        "sample_rate": plan["sample_rate"],
        "steps": plan["steps"],
        "noise_multiplier": plan["noise_multiplier"],
        "gradient_noise_multiplier": plan["gradient_noise_multiplier"],
        "trial_epsilon": plan["trial_epsilon"],
    }


def upgrade() -> None:
    connection = op.get_bind()
    for job_id, spec, plan in connection.execute(sa.select(JOB.c.id, JOB.c.spec, JOB.c.plan)):
        if "shapes" in plan or "steps" not in plan:  # planned already, or never planned
            continue
        plan = {**plan, "shapes": [_shape(spec, plan)]}
        connection.execute(JOB.update().where(JOB.c.id == job_id).values(plan=plan))


def downgrade() -> None:
    connection = op.get_bind()
    for job_id, plan in connection.execute(sa.select(JOB.c.id, JOB.c.plan)):
        if "shapes" not in plan:
            continue
        if plan.get("steps") is None:
            raise RuntimeError(f"job {job_id} searches batch size or epochs: no older form")
        plan = {k: v for k, v in plan.items() if k != "shapes"}
        connection.execute(JOB.update().where(JOB.c.id == job_id).values(plan=plan))
