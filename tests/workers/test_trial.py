"""One trial end to end: every method learns on digits; results and config errors."""

import json

import numpy as np
import pytest
import torch
from randomgen import AESCounter

import workers.trial
from core.config import TrialConfig
from core.entropy import Keystream
from workers.data import Dataset
from workers.dp.randomness import SecureStream, TrialRandomness
from workers.trial import main, run_trial

BASE = {
    "dataset": {"source": "builtin:digits"},
    "model": {"name": "logreg"},
    "epochs": 2,
    "batch_size": 128,
    "physical_batch_size": 64,
    "noise_multiplier": 1.0,
    "optimizer": {"name": "sgd", "lr": 2.0, "momentum": 0.5},
    "device": "cpu",
}

METHODS = {
    "abadi": {},
    "auto_s": {"clipping": "auto_s"},
    "auto_v": {"clipping": "auto_v"},
    "layer_wise": {"style": "layer_wise", "clipping": "auto_s"},
    "param_wise": {"style": "param_wise"},
    "groups": {"style": "groups", "groups": [["1.weight"], ["1.bias"]]},
    "dcsgd_p": {"adaptive": {"rule": "dcsgd_p", "percentile": 0.7}},
    "dcsgd_e": {"adaptive": {"rule": "dcsgd_e"}},
    "andrew": {"adaptive": {"rule": "andrew", "percentile": 0.7}},
    "du": {"adaptive": {"rule": "du", "decay": 0.5}},
}
OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 0.05},
    "adamw": {"name": "adamw", "lr": 0.05, "weight_decay": 0.01},
    "adambc": {"name": "adambc", "lr": 0.05, "gamma_prime": 1e-6},
}


def config(method=None, optimizer=None, **extra):
    body = {**BASE, "method": {"per_sample": "general", **(method or {})}, **extra}
    if optimizer:
        body["optimizer"] = optimizer
    return TrialConfig.model_validate(body)


@pytest.mark.parametrize("name", METHODS)
def test_each_method_learns(name):
    result = run_trial(config(METHODS[name])).result
    assert result["score"]["value"] > 0.6, result["score"]  # chance is 0.1
    assert result["steps"] == round(2 / result["sample_rate"])
    adaptive = "adaptive" in METHODS[name]
    assert (result["thresholds"] is not None) == adaptive
    # a small model faults no pages in: its micro-batches stay as configured (workers.dp.physical)
    assert result["timings"]["physical_batch_size"] == BASE["physical_batch_size"]
    if adaptive:
        assert len(result["thresholds"]) == result["steps"]
        assert len(set(result["thresholds"])) > 1


def test_each_epoch_is_labelled_once_where_rounding_leaves_the_last_one_short():
    """3 epochs of B = 64 on digits' 1797 rows are 84 steps, 2.99 epochs: the last rows are the
    third epoch's (they were labelled the second's, twice)."""
    seen = []
    result = run_trial(
        config(epochs=3, batch_size=64),
        on_epoch=lambda rows: seen.append({r["epoch"] for r in rows}),
    ).result
    assert 2.9 < result["steps"] * result["sample_rate"] < 3
    assert seen == [{1}, {2}, {3}]
    assert {r["epoch"] for r in result["metrics"]} == {1, 2, 3}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_learns(name):
    result = run_trial(config(optimizer=OPTIMIZERS[name])).result
    assert result["score"]["value"] > 0.6, result["score"]


def test_dcsgd_splits_the_noise_and_costs_dpsgd_with_sigma():
    dc = run_trial(config(METHODS["dcsgd_e"], epochs=0.5)).result
    plain = run_trial(config(epochs=0.5)).result
    assert dc["grad_noise_multiplier"] ** -2 == pytest.approx(1.0 - 5.0**-2)
    assert dc["epsilon"] == pytest.approx(plain["epsilon"])
    assert dc["thresholds"][0] == 1.0  # C₀; the new threshold applies from the next step


def test_private_validation_is_noisy_and_charged():
    public = run_trial(config(epochs=0.5)).result
    private = run_trial(config(epochs=0.5, validation={"split": "private", "noise": 2.0})).result
    assert private["score"]["split"] == "private" and private["score"]["noise"] == 2.0
    assert private["epsilon"] > public["epsilon"]
    assert private["dataset"]["splits"] == {"train": "private", "val": "private"}
    # q and T come from the registered size, as in the service's plan
    assert (private["sample_rate"], private["steps"]) == (public["sample_rate"], public["steps"])
    assert all(m["visibility"] == "private" for m in private["metrics"])
    assert {m["visibility"] for m in public["metrics"] if m["name"].startswith("val")} == {"public"}
    assert all(
        m["visibility"] == "private" for m in public["metrics"] if m["name"].startswith("train")
    )


def test_target_epsilon_is_calibrated():
    result = run_trial(config(epochs=0.5, noise_multiplier=None, target_epsilon=2.0)).result
    assert 2.0 * 0.99 <= result["epsilon"] <= 2.0


def test_heavy_tail_reports_group_accuracy_and_needs_private_validation():
    body = {
        "dataset": {"source": "builtin:heavy_tail", "options": {"scale": 0.02, "groups": 4}},
        "batch_size": 16,
    }
    with pytest.raises(ValueError, match=r"validation.split"):
        run_trial(config(**body))
    result = run_trial(config(**body, validation={"split": "private", "noise": 1.0})).result
    names = {m["name"] for m in result["metrics"]}
    assert {"train_accuracy_group0", "train_accuracy_group3"} <= names


def test_training_metrics_cover_every_group_of_a_dataset_stored_by_class(monkeypatch):
    """The training metrics read a bounded subset spread over the whole training set: its
    first examples alone would hold only the most frequent class of heavy_tail's data."""
    monkeypatch.setattr(workers.trial, "TRAIN_EVAL_EXAMPLES", 100)
    y = torch.tensor([0] * 200 + [1] * 60 + [2] * 40)
    data = Dataset("sorted", torch.randn(300, 4), y, 3, class_group=torch.tensor([0, 1, 2]))
    rows = workers.trial._epoch_metrics(torch.nn.Linear(4, 3), data, 1, 256)
    names = {r["name"] for r in rows}
    assert {f"train_accuracy_group{g}" for g in range(3)} <= names


def test_cli_writes_result_and_rejects_bad_configs(tmp_path, capsys):
    good, out = tmp_path / "trial.json", tmp_path / "result.json"
    good.write_text(json.dumps({**BASE, "epochs": 0.3, "method": {"per_sample": "general"}}))
    assert main(["--config", str(good), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in (
        "config",
        "sample_rate",
        "steps",
        "noise_multiplier",
        "grad_noise_multiplier",
        "epsilon",
        "delta",
        "thresholds",
        "metrics",
        "score",
        "wall_time_s",
        "device",
    ):
        assert key in result

    cases = {
        "method.clipping": {"method": {"clipping": "nope"}},
        "optimizer.lrate": {"optimizer": {"lrate": 0.1}},
        "noise_multiplier": {"noise_multiplier": None},
        "method.adaptive.histogram_noise": {
            "noise_multiplier": 6.0,
            "method": {"per_sample": "general", "adaptive": {"rule": "dcsgd_p"}},
        },
        "model.options.width": {"model": {"name": "mlp", "options": {"width": 3}}},
        "dataset.options.scale": {"dataset": {"source": "builtin:digits", "options": {"scale": 2}}},
        "batch_size": {"batch_size": 5000},
    }
    for field, change in cases.items():
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**BASE, **change}))
        assert main(["--config", str(bad), "--out", str(tmp_path / "x.json")]) == 2
        assert field in capsys.readouterr().err, field


class KeyedStream(SecureStream):
    """A stream with a fixed key: test double for replaying a trial's randomness."""

    def __init__(self, key: int) -> None:
        self.numpy = np.random.Generator(AESCounter(key=key, counter=0))
        self.keystream = Keystream(key.to_bytes(16, "little"))


class Replay(TrialRandomness):
    def __init__(self) -> None:
        names = ("sampling", "gradient", "release", "validation", "holdout", "init")
        for key, name in enumerate(names, start=1):
            setattr(self, name, KeyedStream(key))


def test_fast_and_general_paths_train_the_same_model(monkeypatch):
    monkeypatch.setattr(workers.trial, "TrialRandomness", Replay)
    method = {**METHODS["dcsgd_p"], "style": "layer_wise"}
    runs = [
        run_trial(
            config(
                {**method, "per_sample": path},
                epochs=0.5,
                model={"name": "mlp", "options": {"hidden": 16}},
            )
        ).result
        for path in ("general", "fast")
    ]
    assert runs[0]["thresholds"] == pytest.approx(runs[1]["thresholds"], rel=1e-4)
    assert runs[0]["score"]["value"] == pytest.approx(runs[1]["score"]["value"], abs=0.01)
