"""The audit end to end: it catches a broken build, stays under the claim on a correct one,
and its canaries enter the engine as the examples they stand for."""

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from core.config import TrialConfig
from service.cli import app
from workers.audit import run_audit
from workers.audit.canaries import GradientCanaries
from workers.audit.clipper import CanaryClipper
from workers.data import load_dataset
from workers.dp import clipped_grad_sum, coefficient_fn
from workers.dp.randomness import SecureStream
from workers.trial import plan_privacy

CONFIG = {
    "dataset": {"source": "builtin:digits"},
    "model": {"name": "mlp", "options": {"hidden": 64, "layers": 1}},
    "epochs": 5,
    "batch_size": 64,
    "target_epsilon": 1.0,
    "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
    "device": "cpu",
}
CANARIES, GUESSES = 1000, 200


@pytest.fixture(autouse=True)
def one_thread():
    """A 2-core machine shared with other jobs runs these small steps faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cfg() -> TrialConfig:
    return TrialConfig.model_validate(CONFIG)


def test_noise_scaled_down_is_caught(cfg):
    result = run_audit(cfg, canaries=CANARIES, guesses=GUESSES, noise_scale=0.1)
    assert result.lower_bound > result.claimed_epsilon, result
    assert result.refuted


@pytest.mark.parametrize("kind", ["white", "black"])
def test_correct_build_stays_under_its_claim(cfg, kind):
    result = run_audit(cfg, canaries=CANARIES, guesses=GUESSES, kind=kind)
    assert 0 <= result.lower_bound < result.claimed_epsilon, result
    assert result.claimed_epsilon == pytest.approx(1.0, rel=1e-3)


def test_canaries_count_toward_n(cfg):
    result = run_audit(cfg, canaries=10, guesses=10, kind="black")
    size = load_dataset(cfg.dataset).size
    plan = plan_privacy(cfg, size + 10)
    assert result.sample_rate == cfg.batch_size / (size + 10)
    assert (result.steps, result.noise_multiplier) == (plan.steps, plan.noise_multiplier)
    assert result.claimed_epsilon == plan.epsilon(cfg.delta)[0]


@pytest.mark.parametrize("clipping", ["abadi", "auto_s"])
def test_gradient_canaries_are_clipped_examples(clipping):
    """A canary row adds C·u_i clipped by the engine's clip function (norm ≤ R_m per group),
    reports norms R_m, and leaves the real rows' norms and clipped sum as they were."""
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    params = dict(model.named_parameters())
    groups = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    column_groups = torch.cat(
        [torch.full((p.numel(),), 0 if name.startswith("0.") else 1) for name, p in params.items()]
    )
    canaries = GradientCanaries.draw(6, column_groups, 2, SecureStream())
    threshold = 2.0
    clipper = CanaryClipper(clipped_grad_sum, canaries, params, threshold=lambda: threshold)
    coef_fn = coefficient_fn(clipping, threshold, 2)
    loss = nn.CrossEntropyLoss(reduction="none")
    x, y = torch.randn(4, 5), torch.tensor([0, 2, 1, 1])
    rows = torch.cat([x, torch.zeros(2, 5)]), torch.cat([y, torch.tensor([-1 - 4, -1 - 0])])

    norms, sums = clipper(model, loss, *rows, groups, coef_fn)
    real_norms, real_sums = clipped_grad_sum(model, loss, x, y, groups, coef_fn)

    r_m = threshold / 2**0.5
    assert torch.allclose(norms[:4], real_norms)
    assert torch.allclose(norms[4:], torch.full((2, 2), r_m, dtype=torch.float64))
    factors = canaries.clipped_factors(coef_fn, threshold)
    added = torch.cat([(sums[n] - real_sums[n]).flatten() for n in params])
    expected = (
        (canaries.directions[4] + canaries.directions[0])
        * threshold
        * factors.to(torch.float32)[column_groups]
    )
    assert torch.allclose(added, expected, atol=1e-6)
    for g in range(2):  # each canary's block has norm R_m before clipping, ≤ R_m after
        block = canaries.directions[4][column_groups == g] * threshold
        assert block.norm() == pytest.approx(r_m, rel=1e-5)
        assert (factors[g] <= 1) and (factors[g] == 1) == (clipping == "abadi")
    real = torch.cat([real_sums[n].flatten() for n in params])
    assert torch.allclose(clipper.take_real_sum(), real, atol=1e-6)
    assert not clipper.take_real_sum().any()


def test_cli_reports_a_refuted_claim(tmp_path):
    config, out = tmp_path / "trial.json", tmp_path / "audit.json"
    config.write_text(json.dumps({**CONFIG, "epochs": 2}))
    result = CliRunner().invoke(
        app,
        [
            "audit",
            "--config",
            str(config),
            "-m",
            "500",
            "-k",
            "100",
            "--noise-scale",
            "0.1",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output and "FAULT INJECTED" in result.output
    report = json.loads(out.read_text())
    assert report["refuted"] and report["lower_bound"] > report["claimed_epsilon"]
    assert (report["canaries"], report["guesses"], report["noise_scale"]) == (500, 100, 0.1)
    assert report["ratio"] == report["lower_bound"] / report["claimed_epsilon"]


def test_cli_names_bad_input(tmp_path):
    config = tmp_path / "trial.json"
    config.write_text(json.dumps({**CONFIG, "batch_size": 0}))
    result = CliRunner().invoke(app, ["audit", "--config", str(config)])
    assert result.exit_code == 2 and "batch_size" in result.output
    config.write_text(json.dumps(CONFIG))
    result = CliRunner().invoke(app, ["audit", "--config", str(config), "-m", "10", "-k", "20"])
    assert result.exit_code == 2 and "guesses" in result.output
