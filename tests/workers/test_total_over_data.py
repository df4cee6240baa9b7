"""Invariant 13 (docs/design.md): a trial is total over its data.

One planted record — a feature, or every feature, set to ±3e38, ±1e30, ±float32's max, NaN or
±inf at a seeded random position — must not fail a trial or change what an analyst sees: the
trial completes, its score is finite, the whole result is JSON (no NaN, no Infinity), the
public rows are the clean run's rows, and the runner's progress encoding takes every row.
Finite extremes go through an npz file and the loader's registration check (they pass it);
NaN and ±inf, which registration refuses (invariant 9), are handed to the trial directly, since
the engine must not depend on that check alone.

Cases are sampled so that each built-in model meets both per-sample paths and several values,
and every value, style, adaptive rule and validation split comes up: a covering set rather
than the full product, which keeps the file to seconds.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import workers.trial
from core.config import ModelConfig, TrialConfig
from runner.client import ControlPlane, Progress
from workers.data import Dataset, load_dataset
from workers.metrics import evaluate
from workers.models import build_model
from workers.trial import run_trial

F32_MAX = float(np.finfo(np.float32).max)
VALUES = [3e38, -3e38, 1e30, -1e30, F32_MAX, -F32_MAX, math.nan, math.inf, -math.inf]
MODELS = {  # name: (options, input shape): small, so that each trial takes a fraction of a second
    "logreg": ({}, (2, 3, 3)),
    "mlp": ({"hidden": 16}, (12,)),
    "cnn": ({}, (1, 8, 8)),
    "resnet18": ({"width": 4, "norm_groups": 2}, (1, 4, 4)),
    "resnet34": ({"width": 2, "norm_groups": 1}, (1, 4)),
    "lstm": ({"hidden": 5}, (3, 4)),
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (3, 4)),
}
PATHS = ["fast", "general"]
STYLES = ["all_layer", "layer_wise", "param_wise", "groups"]
WHERE = ["feature", "record"]  # one feature of the record, or all of them
ADAPTIVE: list[dict[str, Any] | None] = [
    None,
    {"rule": "dcsgd_p", "percentile": 0.7},
    None,
    {"rule": "dcsgd_e"},
    None,
    {"rule": "andrew", "percentile": 0.7},
    None,
    {"rule": "du", "decay": 0.5},
]
SPLITS = ["public", "private"]
N, N_VAL, CLASSES = 48, 16, 3
ROUNDS = 3


def _cases() -> list[tuple[str, str, str, float, str, dict[str, Any] | None, str, int]]:
    """Every (model, path) pair ``ROUNDS`` times, with the other axes cycled over them: each
    pair meets several values, and each value, style, placement, rule and split comes up."""
    pairs = list(itertools.product(MODELS, PATHS))
    return [
        (
            *pairs[i % len(pairs)],
            STYLES[i % len(STYLES)],
            VALUES[i % len(VALUES)],
            WHERE[i // 2 % len(WHERE)],
            ADAPTIVE[i % len(ADAPTIVE)],
            SPLITS[i // 3 % len(SPLITS)],
            i,
        )
        for i in range(ROUNDS * len(pairs))
    ]


CASES = [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}-{case[3]:g}-{case[4]}")
    for case in _cases()
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _arrays(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(N, *shape)).astype(np.float32),
        "y": rng.integers(0, CLASSES, N),
        "x_val": rng.normal(size=(N_VAL, *shape)).astype(np.float32),
        "y_val": rng.integers(0, CLASSES, N_VAL),
    }


def _plant(arrays: dict[str, np.ndarray], value: float, where: str, seed: int) -> None:
    """Set one feature (``where="feature"``) or every feature of one training record."""
    rng = random.Random(seed)
    record = arrays["x"][rng.randrange(N)].reshape(-1)
    if where == "record":
        record[:] = value
    else:
        record[rng.randrange(len(record))] = value


def _groups(model: str) -> list[list[str]]:
    """Two groups, every other trainable parameter each."""
    options, shape = MODELS[model]
    built = build_model(ModelConfig(name=model, options=options), shape, CLASSES)
    names = [n for n, p in built.named_parameters() if p.requires_grad]
    return [names[::2], names[1::2]]


def _config(
    model: str, path: str, style: str, adaptive: dict[str, Any] | None, split: str, source: str
) -> TrialConfig:
    options, _ = MODELS[model]
    method: dict[str, Any] = {"per_sample": path, "style": style, "adaptive": adaptive}
    if style == "groups":
        method["groups"] = _groups(model)
    validation = {"split": split, "noise": 1.0} if split == "private" else {"split": split}
    return TrialConfig.model_validate(
        {
            "dataset": {"source": source, "num_classes": CLASSES},
            "model": {"name": model, "options": options},
            "epochs": 1,
            "batch_size": 16,
            "physical_batch_size": 16,
            "noise_multiplier": 1.0,
            "optimizer": {"name": "sgd", "lr": 0.5},
            "method": method,
            "validation": validation,
            "device": "cpu",
        }
    )


def _run(
    cfg: TrialConfig, arrays: dict[str, np.ndarray], where: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """The trial on ``arrays``, through an npz file in the folder ``where`` when registration
    admits them; and the metric rows it reported each epoch."""
    where.mkdir()
    np.savez(where / "data.npz", **arrays)
    try:
        load_dataset(cfg.dataset, where)
    except ValueError as refused:
        assert "non-finite" in str(refused)  # NaN, ±inf: refused at registration (invariant 9)
        data = Dataset(
            "planted",
            torch.from_numpy(arrays["x"]),
            torch.from_numpy(arrays["y"]),
            CLASSES,
            torch.from_numpy(arrays["x_val"]),
            torch.from_numpy(arrays["y_val"]),
            val_public=True,
        )
        monkeypatch.setattr(workers.trial, "load_cached", lambda *_: data)
    reported: list[list[dict[str, Any]]] = []
    result = run_trial(cfg, on_epoch=reported.append, data_dir=where).result
    monkeypatch.undo()
    return result, reported


def _shape(result: dict[str, Any]) -> Any:
    """What an analyst may see of a result, values aside: its keys, the score's, and the
    metric rows (public ones with their values' types)."""
    rows = [
        (
            m["epoch"],
            m["name"],
            m["visibility"],
            type(m["value"]) if m["visibility"] == "public" else None,
        )
        for m in result["metrics"]
    ]
    return sorted(result), sorted(result["score"]), rows


def _sent(rows: list[list[dict[str, Any]]]) -> list[Any]:
    """What the runner's progress client sends the control plane for these rows, parsed as
    strict JSON (httpx refuses to encode NaN and ±Infinity)."""
    bodies: list[Any] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content, parse_constant=_not_json))
        return httpx.Response(204)

    api = ControlPlane("http://control", "token", 1)
    api.http = httpx.Client(transport=httpx.MockTransport(answer))
    progress = Progress(api, attempt=1, every_s=0.0)
    for epoch, epoch_rows in enumerate(rows, start=1):
        progress.add(epoch, [{**r, "public": r["visibility"] == "public"} for r in epoch_rows])
    progress.flush()
    return bodies


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


@pytest.mark.parametrize(
    ("model", "path", "style", "value", "where", "adaptive", "split", "seed"), CASES
)
def test_a_planted_record_changes_nothing_an_analyst_sees(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    path: str,
    style: str,
    value: float,
    where: str,
    adaptive: dict[str, Any] | None,
    split: str,
    seed: int,
) -> None:
    _, shape = MODELS[model]
    arrays = _arrays(shape, seed)
    cfg = _config(model, path, style, adaptive, split, "npz:data.npz")
    clean, _ = _run(cfg, arrays, tmp_path / "clean", monkeypatch)
    _plant(arrays, value, where, seed)
    planted, reported = _run(cfg, arrays, tmp_path / "planted", monkeypatch)

    for result in (clean, planted):
        assert math.isfinite(result["score"]["value"]), result["score"]
        json.dumps(result, allow_nan=False)
    assert _shape(planted) == _shape(clean)
    assert [r for rows in reported for r in rows] == planted["metrics"]
    sent = _sent(reported)
    assert [r["value"] for body in sent for r in body["metrics"]] == [
        r["value"] for r in planted["metrics"]
    ]


def _linear(weight: list[list[float]]) -> torch.nn.Module:
    layer = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
    return layer


def test_finite_extreme_logits_give_a_finite_loss() -> None:
    """Logits ±3e38 are finite in float32, their cross-entropy (6e38) is not: the loss is
    formed in float64."""
    model = _linear([[3e38, 0.0], [-3e38, 0.0], [0.0, 1.0]])
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1, 2])
    got = evaluate(model, x, y, batch_size=1)
    big = float(torch.tensor(3e38))  # as float32 holds it
    assert got.loss == pytest.approx((2 * big + math.log(2 + math.e) - 1) / 2, rel=1e-12)
    assert (got.correct, got.total, got.predictions.tolist()) == (1, 2, [0, 2])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_an_example_whose_logits_are_not_finite_predicts_no_class(value: float) -> None:
    """Its loss is None (JSON null), and it counts as wrong whatever argmax makes of NaN: the
    count stays a count of examples, one per record."""
    model = _linear([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    x = torch.tensor([[value, 0.0], [0.0, 1.0]])
    for label in range(CLASSES):
        got = evaluate(model, x, torch.tensor([label, 2]))
        assert got.loss is None
        assert (got.correct, got.predictions.tolist()) == (1, [-1, 2])
