"""The closing table of a job's log (``runner.summary``): what each Tune trial ran and cost,
the job's charge and the released trial, laid out for the Ray dashboard's log viewer."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.accounting import tuning_epsilon
from core.config import DatasetConfig
from core.plan import Plan
from core.spec import JobSpec
from runner.job import JobContext
from runner.summary import TrialRow, keep_alignment, show, trial_row

PLAN = {
    "accounting": "rdp",
    "sample_rate": 0.05,
    "noise_multiplier": 1.2,
    "gradient_noise_multiplier": 1.2,
    "steps": 40,
    "shapes": [
        {
            "batch_size": 64,
            "epochs": 2.5,
            "sample_rate": 0.05,
            "steps": 40,
            "noise_multiplier": 1.2,
            "gradient_noise_multiplier": 1.2,
            "trial_epsilon": 1.0,
        }
    ],
    "validation_noise": None,
    "trials": {"distribution": "fixed", "mean": 3, "max": 3},
    "attempts_reserved": 3,
    "trial_epsilon": 1.0,
    "epsilon": 1.6,
    "delta": 1e-5,
    "method": {"kind": "rdp", "trials": 3},
    "defaults": {},
}


def tune_trial(
    index: int, status: str, result: dict[str, Any], failures: int = 0, **params: Any
) -> SimpleNamespace:
    """What ``runner.summary`` reads of a Tune ``Trial``."""
    trial = {"index": index, "params": params} if params else {"index": index}
    return SimpleNamespace(
        config={"trial": trial}, status=status, last_result=result, num_failures=failures
    )


def test_a_row_counts_the_attempts_that_ran() -> None:
    finished = tune_trial(0, "TERMINATED", {"steps": 40, "dp_score": 0.9}, 1, lr=0.1)
    assert trial_row(finished) == TrialRow(0, {"lr": 0.1}, "finished", 40, 0.9, 2)
    failed = tune_trial(1, "ERROR", {"steps": 12}, 2, lr=0.5)
    assert trial_row(failed) == TrialRow(1, {"lr": 0.5}, "failed", 12, None, 2)
    refused = tune_trial(2, "TERMINATED", {}, 1, lr=0.5)  # retried, then refused: ran once
    assert trial_row(refused) == TrialRow(2, {"lr": 0.5}, "not run", None, None, 1)
    # a random-stopping trial's config holds only its index: it reported what it drew
    drawn = tune_trial(3, "TERMINATED", {"steps": 40, "dp_score": 0.8, "params": {"lr": 0.2}})
    assert trial_row(drawn).params == {"lr": 0.2}


def context(search_space: dict[str, Any]) -> JobContext:
    return JobContext(
        job_id=7,
        control_url="http://control",
        token="dpr_x",
        data_dir=Path("/nonexistent"),
        spec=JobSpec.model_validate(
            {
                "dataset": 1,
                "model": {"name": "mlp"},
                "privacy": {"epsilon": 1.6, "accounting": "rdp"},
                "search_space": search_space,
            }
        ),
        plan=Plan.model_validate(PLAN),
        dataset=DatasetConfig(source="builtin:digits"),
        trials=3,
        candidates=None,
    )


def test_the_log_ends_with_the_trials_the_charge_and_the_release() -> None:
    rows = [
        TrialRow(0, {"optimizer.lr": 0.1}, "finished", 40, 0.8125, 2),
        TrialRow(1, {"optimizer.lr": 0.5}, "finished", 40, 0.9, 1),
        TrialRow(2, {"optimizer.lr": 1.0}, "not run", None, None, 0),
    ]
    out = io.StringIO()
    show(context({"optimizer.lr": {"grid": [0.1, 0.5, 1.0]}}), rows, 1, (2.5, 1e-5), out)
    text = out.getvalue().replace("\u00a0", " ")
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "dptune job 7: trials"
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line[0] == "│"]
    assert cells[0] == ["trial", "optimizer.lr", "status", "steps", "DP score", "ε", "attempts"]
    # each trial's ε: its attempts composed, as an rdp job of that many trials costs
    two, one = (tuning_epsilon(0.05, 1.2, 40, 1e-5, "rdp", trials=n) for n in (2, 1))
    assert cells[1:] == [
        ["0", "0.1", "finished", "40", "0.8125", f"{two:.4g}", "2"],
        ["1", "0.5", "finished", "40", "0.9", f"{one:.4g}", "1"],
        ["2", "1", "not run", "-", "-", "-", "0"],
    ]
    assert two > one
    assert lines[-2:] == [
        "charged: ε = 2.5 at δ = 1e-05 (rdp)",
        "released: trial 1 (optimizer.lr = 0.5), DP score 0.9",
    ]


def test_a_job_that_released_nothing_says_so() -> None:
    out = io.StringIO()
    show(context({}), [TrialRow(0, {}, "failed", 3, None, 1)], None, (0.4, 1e-5), out)
    assert out.getvalue().splitlines()[-1] == "released: nothing (no trial finished)"


@pytest.mark.parametrize(
    "line",
    [
        "| run_candidate_00000 | TERMINATED |   0.5 |",
        "+---------------------+------------+-------+",
        "│     0 │ finished │",
        "╭───────┬──────────╮",
    ],
)
def test_table_lines_keep_their_spaces_in_the_dashboard(line: str) -> None:
    """The dashboard's log viewer collapses runs of plain spaces, not no-break ones."""
    kept = keep_alignment(f"Current best trial: 0\n{line}\n")
    first, table = kept.splitlines()
    assert first == "Current best trial: 0"  # searchable as written
    assert " " not in table and table.replace("\u00a0", " ") == line
