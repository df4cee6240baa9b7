"""torch.profiler tables of the product's DP step (``fast``) on CUDA: where its GPU time and
its host time go, sorted by each, over three steady steps.

    python bench/device/profile_step.py resnet18 64 256     # model, then batch sizes

Written for a lent GPU (``bench/device/run.sh``); on CPU it profiles the CPU step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import step_overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(step_overhead.MODELS))
    parser.add_argument("batches", nargs="+", type=int)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step_overhead._start_runtime(device)
    for batch in args.batches:
        step = step_overhead._build_step(args.model, batch, "fast", device, "all_layer")
        for _ in range(6):  # first-use set-up
            step()
        sync()
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
            sync()
        table = prof.key_averages().table
        print(f"{args.model}, B = {batch}, three steps on {device}")
        if device == "cuda":
            print(table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        print(table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
