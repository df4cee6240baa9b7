"""``dptune account`` end to end through the real CLI."""

import json

import pytest
from dp_accounting import dp_event, pld
from typer.testing import CliRunner

from core.accounting import dpsgd_epsilon, liu_talwar, rdp_curve
from service.cli import app

runner = CliRunner()


def run_json(*args: str) -> list[dict]:
    result = runner.invoke(app, ["account", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_cost_of_every_method_side_by_side() -> None:
    rows = run_json(
        "--dataset-size",
        "1797",
        "--batch-size",
        "64",
        "--epochs",
        "10",
        "--noise",
        "1.2",
        "--trials",
        "8",
    )
    assert [r["method"] for r in rows] == ["single", "rdp", "lt", "ps"]
    single, rdp, lt, ps = rows
    assert single["steps"] == round(10 * 1797 / 64)
    assert single["sample_rate"] == 64 / 1797
    assert single["rdp_epsilon"] == dpsgd_epsilon(64 / 1797, 1.2, single["steps"], 1e-5)
    assert lt["params"] == {"gamma": 1 / 8, "delta2": 1e-5 / 2}  # planning's default
    bound = liu_talwar(rdp_curve(64 / 1797, 1.2, single["steps"]), 1e-5, 1 / 8, 1e-5 / 2)
    assert lt["max_trials"] == bound.max_trials
    assert single["epsilon"] < ps["epsilon"] < rdp["epsilon"] < lt["epsilon"]
    assert [r["bound"] for r in rows] == ["pld", "pld", "rdp", "profile"]
    assert all(r["epsilon"] <= r["rdp_epsilon"] for r in rows)


@pytest.mark.parametrize(("sigma", "trials"), [(0.8, 1), (1.2, 8), (2.0, 3)])
def test_a_fixed_k_is_stated_by_its_pessimistic_pld(sigma: float, trials: int) -> None:
    """ε of K runs by dp-accounting's own PLD accountant (its default discretization), composed
    of the K·T subsampled Gaussian steps: the CLI's PLD statement agrees to a few per cent and
    is below RDP's."""
    q, steps = 0.05, 200
    [row] = run_json("-q", str(q), "--steps", str(steps), "-s", str(sigma), "--method", "rdp",
                     "--trials", str(trials))  # fmt: skip
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant = pld.PLDAccountant().compose(event, steps * trials)
    assert row["bound"] == "pld"
    assert row["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=0.03)
    assert row["epsilon"] < row["rdp_epsilon"]


def test_noise_for_a_target() -> None:
    rows = run_json(
        "-q",
        "0.01",
        "--steps",
        "500",
        "--target-epsilon",
        "3",
        "--method",
        "ps",
        "--poisson",
        "--histogram-noise",
        "20",
    )
    (row,) = rows
    assert row["params"]["eta"] is None
    assert 3 * (1 - 1e-3) <= row["epsilon"] <= 3
    assert row["gradient_noise"] > row["noise_multiplier"]


def test_bad_input_is_a_clear_error() -> None:
    result = runner.invoke(app, ["account", "-q", "0.01", "--steps", "10"])
    assert result.exit_code != 0
    assert "--noise" in result.output
    result = runner.invoke(app, ["account", "-q", "2", "--steps", "10", "-s", "1"])
    assert result.exit_code != 0
    assert "sample_rate" in result.output


def test_help_explains_each_method() -> None:
    result = runner.invoke(app, ["account", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for line in ("single:", "rdp:", "lt:", "ps:"):
        assert line in result.output
