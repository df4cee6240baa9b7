"""``bench/norm_paths.py`` times the product's step with its norms' two paths in turn; a tiny
instance, and the product's setting restored afterwards."""

from __future__ import annotations

import pytest

from workers.dp import clipping


def test_both_paths_run_and_the_setting_is_restored(
    bench, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    guarded: list[int] = []  # float32 blocks: logreg's 32 x 9216 input is above BLOCKS_ABOVE
    guard = clipping._float32_guard
    monkeypatch.setattr(clipping, "_float32_guard", lambda s, n: guarded.append(n) or guard(s, n))
    setting = clipping.BLOCKS_ABOVE
    results = bench("norm_paths").main(
        ["--models", "logreg", "--batches", "32", "--rounds", "2", "--steps", "1"]
    )
    got = results[("logreg", 32)]
    assert got["float64"] > 0 and got["float32 blocks"] > 0 and guarded
    assert setting == clipping.BLOCKS_ABOVE
    ratio = got["float32 blocks"] / got["float64"]
    assert f"| logreg | 32 | {1000 * got['float64']:.2f} |" in capsys.readouterr().out
    assert ratio > 0
