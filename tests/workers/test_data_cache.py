"""The per-process dataset cache of trial processes (``workers.data.load_cached``): data read
once per process, never served after the file changed, never more than a few datasets."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from core.config import DatasetConfig, TrialConfig
from workers import data, trial
from workers.data import content_sha256, load_cached, load_dataset
from workers.trial import run_trial

BASE = {
    "model": {"name": "logreg"},
    "epochs": 1,
    "batch_size": 32,
    "noise_multiplier": 1.0,
    "optimizer": {"name": "sgd", "lr": 0.5},
    "validation": {"split": "public"},
    "device": "cpu",
}


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    data._cache.clear()


def write(path: Path, seed: int, validation: bool = False) -> None:
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.normal(size=(200, 4)).astype(np.float32), "y": rng.integers(0, 3, 200)}
    if validation:
        arrays |= {"x_val": rng.normal(size=(50, 4)).astype(np.float32), "y_val": arrays["y"][:50]}
    partial = path.with_suffix(".partial")
    with partial.open("wb") as f:
        np.savez(f, **arrays)
    os.replace(partial, path)  # as an upload lands (service.api.datasets)


def config(path: Path) -> DatasetConfig:
    raw = load_dataset(DatasetConfig(source=f"npz:{path.name}", num_classes=3), path.parent)
    return DatasetConfig(source=f"npz:{path.name}", num_classes=3, sha256=content_sha256(raw))


def test_a_file_is_read_once_until_a_new_upload_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    write(path, 1)
    first = config(path)
    loaded = load_cached(first, tmp_path)
    assert load_cached(first, tmp_path) is loaded  # read once

    write(path, 2)  # a new upload at the same path: never served from before it
    with pytest.raises(ValueError, match=r"dataset\.sha256: the data of npz:d\.npz changed"):
        load_cached(first, tmp_path)  # a job planned on the old data refuses the new
    second = config(path)
    fresh = load_cached(second, tmp_path)
    assert content_sha256(fresh) == second.sha256 != first.sha256


def test_the_cache_holds_a_bounded_number_of_datasets(tmp_path: Path) -> None:
    paths = [tmp_path / f"d{i}.npz" for i in range(data.CACHED_DATASETS + 1)]
    for seed, path in enumerate(paths):
        write(path, seed)
        load_cached(config(path), tmp_path)
    assert len(data._cache) == data.CACHED_DATASETS


class Scribbler(nn.Module):
    """A model that writes into its input when evaluated (an own model may do anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            x.mul_(0.5)
        return self.linear(x)


def test_a_trial_that_writes_into_its_data_leaves_the_next_trials_data_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trials of one process share the loaded arrays; each trains and evaluates on its own
    copy, so what one trial's model does to its inputs cannot reach the next trial."""
    monkeypatch.setattr(trial, "build_model", lambda *_: Scribbler())
    path = tmp_path / "d.npz"
    write(path, 3, validation=True)
    cfg = TrialConfig.model_validate({**BASE, "dataset": config(path).model_dump()})
    cached = load_cached(cfg.dataset, tmp_path)
    before = content_sha256(cached)
    for _ in range(2):
        run_trial(cfg, data_dir=tmp_path)
        assert load_cached(cfg.dataset, tmp_path) is cached
        assert content_sha256(cached) == before
