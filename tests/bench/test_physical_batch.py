"""``bench/physical_batch.py`` runs one logical batch in three splits in turn, then a trial's
choice; a tiny instance (mlp at B = 16 faults nothing, so the choice is one physical batch)."""

from __future__ import annotations

import torch


def test_three_splits_and_the_trials_choice(bench, capsys) -> None:
    module = bench("physical_batch")
    threads = str(torch.get_num_threads())  # main sets torch's threads: keep the test process's
    module.main(["--models", "mlp", "--batch", "16", "--rounds", "2", "--threads", threads])
    out = capsys.readouterr().out
    for physical in (16, 8, 4):
        assert f"| mlp | {physical} |" in out
    assert "| mlp | 16 | " in out and "| 1.00x |" in out
    assert "| mlp | trial's choice: **16** (after 4 steps) |" in out
