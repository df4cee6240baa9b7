"""``bench/heavy_tail.py`` trains every optimizer through the product's DP engine and reports
paper 004's per-frequency-group metrics; a tiny instance, a few steps."""

from __future__ import annotations

import argparse
import math
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def ht(bench) -> ModuleType:
    return bench("heavy_tail")


@pytest.fixture(scope="module")
def data(ht):
    return ht.heavy_tail({"scale": 1 / 32, "groups": 4, "dim": 64})


OPTIMIZERS = ["DP-GD", "DP-GDM", "DP-Adam", "DP-AdamBC"]  # paper 004's four


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains_and_reports_every_group(ht, data, name: str) -> None:
    args = argparse.Namespace(clip=1.0, sigma=10.0, steps=4, points=2, device="cpu")
    _, lrs, gammas = ht.OPTIMIZERS[name]
    run = ht.train(data, name, lrs[0], gammas[0], args, seed=0)
    assert [p["step"] for p in run.curve] == [2, 4]
    last = run.curve[-1]
    assert len(last["group_loss"]) == len(last["group_accuracy"]) == 4
    assert all(math.isfinite(v) for v in last["group_loss"])
    # the loss is the mean over examples, so the group losses weighted by size give it back
    group = data.class_group[data.y]
    sizes = [int((group == g).sum()) for g in range(4)]
    weighted = sum(s * v for s, v in zip(sizes, last["group_loss"], strict=True)) / data.size
    assert weighted == pytest.approx(last["loss"], rel=1e-5)
    # ε grows with the steps as the full-batch Gaussian mechanism's
    assert run.curve[0]["epsilon"] < run.curve[1]["epsilon"]


def test_markdown_table_has_a_row_per_optimizer(ht, data) -> None:
    assert list(ht.OPTIMIZERS) == OPTIMIZERS
    args = argparse.Namespace(clip=1.0, sigma=10.0, steps=2, points=1, device="cpu")
    runs = [{"DP-GD": ht.train(data, "DP-GD", 1.0, None, args, seed=s)} for s in range(2)]
    text = ht.table(runs, 4)
    assert "| DP-GD | 1 |" in text and "| DP-Adam | diverged |" in text
