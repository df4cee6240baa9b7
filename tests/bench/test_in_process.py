"""``bench/in_process.py``: untuned runs and scaling jobs through the product's planner and
trial code in one process, tiny (one epoch of a batch of 256)."""

from __future__ import annotations

import json

import pytest

TINY = {"epochs": 1, "batch_size": 256}
RATES = [0.005, 0.02]

pytestmark = pytest.mark.usefixtures("one_thread")


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_an_untuned_run_is_planned_by_the_product_and_scored_on_the_test_split(
    bench, capsys, tmp_path
) -> None:
    spec = TINY | {"method": {"clipping": "abadi", "threshold": 1.0}}
    out = tmp_path / "runs.jsonl"
    bench("in_process").main(["--epsilon", "4", "--runs", "2", "--spec", json.dumps(spec)])
    bench("in_process").main(["--runs", "1", "--spec", json.dumps(TINY), "--out", str(out)])
    printed = capsys.readouterr().out
    runs = lines(printed)
    assert len(runs) == 3 and all(0 <= r["accuracy"] <= 1 for r in runs)
    assert [r["epsilon"] for r in runs] == [4.0, 4.0, 1.0]
    assert runs[0]["sigma"] < runs[2]["sigma"]  # calibrated to each run's ε, same steps
    assert runs[0]["steps"] == runs[2]["steps"] == 5  # ⌈1294 / 256⌉ steps of one epoch
    assert json.loads(out.read_text()) == runs[2]
    assert "over 2 runs" in printed and "over 1 runs" in printed


@pytest.mark.parametrize("rule", ["by-eps", "held"])
def test_a_scaling_job_runs_every_rate_at_each_level_then_the_final_run(
    bench, capsys, rule: str
) -> None:
    spec = TINY | {"search_space": {"optimizer.lr": {"grid": RATES}}}
    bench("in_process").main(
        ["--epsilon", "4", "--runs", "1", "--scaling", rule, "--spec", json.dumps(spec)]
    )
    [run] = lines(capsys.readouterr().out)
    levels, final = run["levels"], run["final_epsilon"]
    assert len(levels) == 2 and levels[0] < levels[1] < final
    scale = {"by-eps": [e / final for e in levels], "held": [1.0, 1.0]}[rule]
    assert [c[0] for c in run["cheap"]] == [0, 0, 1, 1]
    expected = [rate * scale[level] for level in (0, 1) for rate in RATES]
    assert [c[1] for c in run["cheap"]] == pytest.approx(expected)
    # the picks, unscaled and averaged on a log scale: within the grid up to rounding
    assert min(RATES) * (1 - 1e-9) <= run["final_lr"] <= max(RATES) * (1 + 1e-9)
    assert 0 <= run["accuracy"] <= 1
