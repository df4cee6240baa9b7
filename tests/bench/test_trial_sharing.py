"""``bench/trial_sharing.py``: trials sharing a device against one by one. Its parts (overlap,
utilisation, the GPU reading) and a small run of both jobs on a real Ray head, on CPU."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest


def rows(*spans: tuple[float, float]) -> list[dict[str, float]]:
    return [{"train_started_at": start, "train_s": end - start} for start, end in spans]


def test_at_once_counts_the_trials_training_at_the_same_moment(bench) -> None:
    most_at_once = bench("trial_sharing").most_at_once
    assert most_at_once(rows((0, 2), (2, 4), (4, 6))) == 1  # one ends as the next starts
    assert most_at_once(rows((0, 3), (1, 4), (2, 5), (6, 7))) == 3
    assert most_at_once(rows((0, 10), (1, 2), (3, 4))) == 2
    assert most_at_once([]) == 0


def test_cpu_busy_is_the_busy_share_of_the_jiffies_between_two_readings(bench) -> None:
    sharing = bench("trial_sharing")
    assert sharing.cpu_busy((100, 400), (250, 600)) == pytest.approx(75.0)
    assert sharing.cpu_busy((5, 9), (5, 9)) == 0.0
    busy, total = sharing.cpu_times()
    assert 0 < busy < total


def test_the_gpu_reading_parses_nvidia_smi(bench, tmp_path: Path, monkeypatch) -> None:
    """A stand-in ``nvidia-smi`` on the PATH answers as the real one does for the query."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "37, 1234"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert bench("trial_sharing").gpu_sample() == (37.0, 1234.0)
    assert "--query-gpu=utilization.gpu,memory.used" in (tmp_path / "args").read_text()


def test_modes_ask_for_the_whole_device_or_a_share_of_it(bench) -> None:
    resources = bench("trial_sharing").resources
    assert resources("cuda", 2, 4) == {
        "one by one": {"cpu": 1, "gpu": 1},
        "shared": {"cpu": 1, "gpu": 0.25},
    }
    assert resources("cpu", 2, 2) == {"one by one": {"cpu": 2}, "shared": {"cpu": 1}}


def test_a_small_run_shares_the_cpus_and_reports_both_modes(bench, capsys) -> None:
    results = bench("trial_sharing").main(["--device", "cpu", "--trials", "2", "--epochs", "0.3"])
    one, shared = results["one by one"], results["shared"]
    assert one["trials"] == shared["trials"] == 2
    # one process runs the trials one after another; sharing, two run at once (these trials
    # train for less than a process's start-up, so their training loops need not overlap)
    assert one["processes"] == 1 and shared["processes"] == 2
    assert one["at_once"] == 1 and shared["at_once"] in (1, 2)
    for mode in (one, shared):
        assert 0 < mode["util_pct"] <= 100 and math.isnan(mode["peak_mb"])
        assert mode["train_s"] > 0 and mode["wall_s"] > mode["train_s"]
    out = capsys.readouterr().out
    ratio = shared["trials_per_hour"] / one["trials_per_hour"]
    assert f"shared / one by one: {ratio:.2f}× trials per hour" in out
