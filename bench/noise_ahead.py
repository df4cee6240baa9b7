"""A whole trial with its Gaussian noise drawn ahead on a spare core, against the same trial
with its noise drawn in line, side by side in one run.

    python bench/noise_ahead.py                  # logreg on paper 004's data, B = 64 and 256
    python bench/noise_ahead.py --batches 256 --epochs 2 --repeats 3

Each trial runs through ``workers.trial.run_trial``, the product's path (data, engine, scoring),
with one torch thread. The modes alternate (ahead, in line, ahead, ...) so that both see the
same machine; the table gives each mode's median training time (the trial's own
``timings.train_s``: its steps and epoch metrics) and their ratio. "In line" makes
``workers.trial.spare_core`` answer no for the run, as when torch's threads use every core.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from unittest import mock

import torch

import workers.trial
from core.config import TrialConfig


@dataclass
class Row:
    batch: int
    steps: int
    inline_s: float
    ahead_s: float


def trial_config(dataset: str, model: str, batch: int, epochs: float) -> TrialConfig:
    return TrialConfig.model_validate(
        {
            "dataset": {"source": f"builtin:{dataset}"},
            "model": {"name": model},
            "epochs": epochs,
            "batch_size": batch,
            "noise_multiplier": 1.0,
            "device": "cpu",
            "optimizer": {"name": "sgd", "lr": 0.5},
            "validation": {"split": "private", "noise": 1.0, "fraction": 0.1},
        }
    )


def train_seconds(cfg: TrialConfig, ahead: bool) -> tuple[float, int]:
    """One trial's training time and its number of steps."""
    with mock.patch.object(workers.trial, "spare_core", lambda: ahead):
        result = workers.trial.run_trial(cfg).result
    return result["timings"]["train_s"], result["steps"]


def measure(cfg: TrialConfig, repeats: int) -> Row:
    times: dict[bool, list[float]] = {True: [], False: []}
    steps = 0
    for _ in range(repeats):
        for ahead in (True, False):
            seconds, steps = train_seconds(cfg, ahead)
            times[ahead].append(seconds)
            print(f"  B={cfg.batch_size} {'ahead' if ahead else 'in line'}: {seconds:.2f} s")
    return Row(
        cfg.batch_size, steps, statistics.median(times[False]), statistics.median(times[True])
    )


def table(rows: list[Row], model: str, dataset: str) -> str:
    lines = [
        "| model | dataset | B | steps | in line: train s | ahead: train s | in line / ahead |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {model} | {dataset} | {r.batch} | {r.steps} | {r.inline_s:.2f} | {r.ahead_s:.2f} "
        f"| {r.inline_s / r.ahead_s:.2f}× |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="heavy_tail", help="a built-in dataset")
    parser.add_argument("--model", default="logreg")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="trials per mode and batch")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [
            measure(trial_config(args.dataset, args.model, batch, args.epochs), args.repeats)
            for batch in args.batches
        ]
    finally:
        torch.set_num_threads(threads)
    print(table(rows, args.model, args.dataset))
    return rows


if __name__ == "__main__":
    main()
