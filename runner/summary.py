"""What a job's log ends with, for the operator who reads it in the Ray dashboard: a table of
the job's trials — index, hyperparameters, status, steps, DP score, ε, attempts — then what
the job was charged and the trial it released.

The rows come from Tune's trials as the experiment ended (:class:`TrialLog`); the charge is
the control plane's answer when the job ends (``ControlPlane.end``): the ledger's, not a sum
made here. The log is the operator's (only operators hold the Ray token): nothing here goes
to the control plane, so nothing of it reaches an analyst.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
from ray import tune
from rich import box
from rich.console import Console
from rich.table import Table

from core.accounting import epsilon_from_rdp
from core.shapes import shape_curve, shape_of, trial_curve
from core.spec import SCALING_FIT
from runner.job import JobContext, shown_paths, trial_index


@dataclass(frozen=True)
class TrialRow:
    index: int
    params: dict[str, Any]  # the candidate: in its config, or reported by the trial that drew it
    status: str  # finished | failed | not run
    steps: int | None  # of its last attempt, as last reported
    score: float | None  # its DP selection score, once finished
    attempts: int  # attempts that ran: each read data and is charged


def trial_row(trial: Any) -> TrialRow:
    """One row from a Tune ``Trial``. Tune counts an attempt that raised in ``num_failures``;
    an attempt the control plane refused returns without a score, and ran nothing."""
    result = trial.last_result or {}
    score = result.get("dp_score")
    if score is not None:
        status, attempts = "finished", trial.num_failures + 1
    elif trial.status == "ERROR":
        status, attempts = "failed", trial.num_failures
    else:  # refused (retries used up, the job cancelled), or never started
        status, attempts = "not run", trial.num_failures
    return TrialRow(
        index=trial_index(trial.config),
        params=trial.config["trial"].get("params") or result.get("params") or {},
        status=status,
        steps=result.get("steps"),
        score=score,
        attempts=attempts,
    )


class TrialLog(tune.Callback):
    """Tune callback on the driver: keeps the job's trials when the experiment ends."""

    def __init__(self) -> None:
        self.rows: list[TrialRow] = []

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self.rows = sorted((trial_row(t) for t in trials), key=lambda row: row.index)


#: the first characters of table lines: Tune's (``+---+``, ``| a |``) and ours (rich's box)
_TABLE_LINE = ("+", "|", "╭", "│", "├", "╰")


def keep_alignment(text: str) -> str:
    """``text`` with the spaces of its table lines made no-break spaces: the Ray dashboard's
    log viewer shows each line with CSS ``white-space: nowrap``, which collapses runs of
    spaces and so the columns of a table; a terminal shows both alike."""
    return "".join(
        line.replace(" ", "\u00a0") if line.startswith(_TABLE_LINE) else line
        for line in text.splitlines(keepends=True)
    )


def _value(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trials_table(ctx: JobContext, rows: list[TrialRow]) -> Table:
    """The trials, with each one's ε: ε of its attempts composed (each attempt runs the whole
    trial mechanism of the plan), at the job's δ."""
    plan = ctx.plan
    shapes = plan.shapes

    def curve(params: dict[str, Any]) -> np.ndarray:
        """The trial's shape's curve; the largest shape's bound for a trial that died before
        it reported the candidate it drew."""
        try:
            return shape_curve(shape_of(shapes, params), plan.validation_noise)
        except ValueError:
            return trial_curve(shapes, plan.validation_noise, any_one=True)

    paths = shown_paths(ctx.spec)
    table = Table(title=f"dptune job {ctx.job_id}: trials", box=box.ROUNDED, title_justify="left")
    table.add_column("trial", justify="right")
    for path in paths:
        table.add_column(path, justify="right")
    table.add_column("status")
    for name in ("steps", "DP score", "ε", "attempts"):
        table.add_column(name, justify="right")
    for row in rows:
        eps = (
            epsilon_from_rdp(row.attempts * curve(row.params), plan.delta)[0]
            if row.attempts
            else None
        )
        table.add_row(
            str(row.index),
            *(_value(row.params.get(path)) for path in paths),
            row.status,
            _value(row.steps),
            _value(row.score),
            _value(eps),
            str(row.attempts),
        )
    return table


def show(
    ctx: JobContext,
    rows: list[TrialRow],
    released: int | None,
    charged: tuple[float, float],
    file: TextIO = sys.stdout,
) -> None:
    """Print the trials, the job's charge and the released trial, in plain text: no colour
    and no markup (the dashboard's log viewer shows characters as they are)."""
    table = io.StringIO()
    Console(file=table, width=200, color_system=None, markup=False, highlight=False).print(
        trials_table(ctx, rows)
    )
    file.write(keep_alignment(table.getvalue()))
    epsilon, delta = charged
    print(f"charged: ε = {epsilon:.4g} at δ = {delta:g} ({ctx.plan.accounting})", file=file)
    best = next((row for row in rows if row.index == released), None)
    if best is None:
        print("released: nothing (no trial finished)", file=file, flush=True)
        return
    if ctx.plan.scaling is not None:
        slope, r = (_value(best.params.get(p)) for p in SCALING_FIT)
        final = ctx.plan.scaling.final.epsilon
        print(f"scaling: r = lr·T fitted as {slope}·ε, at the final ε {final:.4g}: {r}", file=file)
    params = ", ".join(f"{p} = {_value(v)}" for p, v in best.params.items())
    print(
        f"released: trial {best.index} ({params or 'the spec as given'}), "
        f"DP score {_value(best.score)}",
        file=file,
        flush=True,
    )
