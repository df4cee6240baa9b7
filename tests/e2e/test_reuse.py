"""Trials without start-up waste: the trials of one job run one after another in the same
Ray worker processes (Tune's actor reuse), each of which reads the dataset once — and every
trial is still recorded, charged and trained on its own."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from .conftest import small_job
from .test_jobs import charged, spent_on


def tune_results(data_dir: Path, job_id: int) -> list[dict[str, Any]]:
    """Each trial's last Tune result (Tune adds the process id), by the start of training."""
    last = [
        json.loads(path.read_text().splitlines()[-1])
        for path in (data_dir / "ray_results" / f"dptune-job-{job_id}").glob("*/result.json")
    ]
    return sorted(last, key=lambda r: r["timings"]["train_started_at"])


def test_a_jobs_trials_share_processes_that_read_the_data_once(service, digits, data_dir) -> None:
    spec = small_job(digits)
    spec["search_space"] = {"method.threshold": {"grid": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]}}
    spec["privacy"]["epsilon"] = 5.0
    spec["epochs"] = 3  # hundredths of a second each: their progress rows go in two calls
    job = service.post("/v1/jobs", spec)
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]

    results = tune_results(data_dir, job["id"])
    assert len(results) == 6
    # no TensorBoard logger in the driver: tensorboardX imports torch, seconds of the job's start
    assert not list((data_dir / "ray_results" / f"dptune-job-{job['id']}").glob("*/events.*"))
    by_process: dict[int, list[dict[str, float]]] = defaultdict(list)
    for result in results:
        by_process[result["pid"]].append(result["timings"])
    # two CPUs, one per trial: at most two processes at a time, each reused after its trial
    assert len(by_process) <= 2 < len(results), by_process
    for timings in by_process.values():
        first, *later = timings
        # imported torch and the engine before its first trial only
        assert all(t["imported_at"] == first["imported_at"] < t["entered_at"] for t in timings), (
            timings
        )
        # read the dataset (load, check, hash) for its first trial only: the others look it up
        # (their median: one lookup a loaded machine pauses may take a while, a read each would
        # take as long as the first)
        if later:
            assert statistics.median(t["load_s"] for t in later) < first["load_s"] / 10, timings

    # each trial still recorded and charged one attempt of its own, before it read data
    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    assert all(t["status"] == "succeeded" and len(t["attempts"]) == 1 for t in trials)
    # every epoch's rows reached the control plane, batched (runner.client.Progress)
    names = ("train_accuracy", "train_loss", "val_accuracy", "val_loss")
    for trial in trials:
        shown = sorted((m["epoch"], m["name"]) for m in trial["metrics"])
        assert shown == [(e, n) for e in (1, 2, 3) for n in names], shown
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert len(charged(budget)) == 6
    assert budget["spent"] == pytest.approx(spent_on(job["plan"], 6), rel=1e-9)
