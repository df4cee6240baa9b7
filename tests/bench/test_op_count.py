"""``bench/op_count.py`` counts the operations a step dispatches (views excluded); a tiny
instance of its table, and the count itself checked on known operations."""

from __future__ import annotations

import torch


def test_views_launch_nothing_and_are_not_counted(bench) -> None:
    x = torch.ones(4, 6)
    with bench("op_count").Count() as count:
        y = x.view(6, 4).t()[1:]  # views only
        (y + 1).sum()
    assert dict(count.by_op) == {"add": 1, "sum": 1}
    assert count.total == 2


def test_the_dp_step_dispatches_more_operations_than_the_non_private(bench, capsys) -> None:
    results = bench("op_count").main(["--models", "mlp", "--batches", "4", "--top", "3"])
    counts = results[("mlp", 4)]
    assert 0 < counts["nonprivate"] < counts["fast_torchrng"]
    captured = capsys.readouterr()
    assert f"| mlp | 4 | {counts['nonprivate']} | {counts['fast_torchrng']} |" in captured.out
    assert "workers/dp/" in captured.err  # the top lines name the product's code
