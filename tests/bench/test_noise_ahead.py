"""``bench/noise_ahead.py`` runs the product's trial with its noise drawn ahead and in line; a
tiny instance."""

from __future__ import annotations

import math


def test_both_modes_train_and_the_table_has_their_ratio(bench, capsys) -> None:
    rows = bench("noise_ahead").main(
        ["--dataset", "digits", "--batches", "32", "--epochs", "0.2", "--repeats", "1"]
    )
    (row,) = rows
    assert row.batch == 32 and row.steps > 0
    assert row.inline_s > 0 and row.ahead_s > 0
    out = capsys.readouterr().out
    assert "ahead:" in out and "in line:" in out
    assert f"{row.inline_s / row.ahead_s:.2f}×" in out and math.isfinite(row.inline_s)
