"""Trials sharing a device against the same trials one by one: trials per hour and utilisation.

Runs two tuning jobs of the same ``--trials`` trials through the product's path (a Ray head
started with ``ray start``, token auth on; ``dptune serve``; a dataset registered and each job
POSTed over HTTP), one after the other:

- **one by one**: each trial asks for the whole device (``{"gpu": 1}``, or on CPU every CPU of
  the head), so Tune runs one at a time;
- **shared**: each trial asks for a ``1/--share`` of it (``{"gpu": 1/k}`` — Ray's fractional
  GPUs — or one CPU each), so ``--share`` trials run at once.

While a job runs, the device's utilisation is sampled every 0.25 s: the GPU's
(``nvidia-smi``: utilisation % and memory in use) or, on CPU, the share of the machine's CPUs busy
(``/proc/stat``). Columns: ``wall`` from the POST to the release; ``trials/h`` = trials ·
3600 / wall; ``Σ train`` the trials' own training loops (their Tune ``timings``);
``processes`` the trial processes (Tune reuses one for the next trial: one by one runs them
all in one, shared in ``--share``); ``at once`` the most trials training at the same moment
(from those timings; trials shorter than a process's start-up may not overlap); ``util``
mean utilisation over the job; ``peak MB`` the GPU's most memory in use.
The last line gives shared / one-by-one trials per hour.

    python bench/trial_sharing.py                # the GPU, if one is visible: 8 trials, 4 at once
    python bench/trial_sharing.py --device cpu   # 2 CPUs: 4 trials, 2 at once (1 CPU each)
    python bench/trial_sharing.py --model resnet18 --dataset digits --epochs 2 --share 4
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # job_overhead: the product's path, shared
from job_overhead import (  # noqa: E402
    dptune_serve,
    job_spec,
    local_cluster,
    run_job,
    trial_timings,
)

#: seconds between utilisation samples
PERIOD_S = 0.25


@dataclass
class Usage:
    """Utilisation samples of one device during one job."""

    busy: list[float] = field(default_factory=list)  # per cent
    memory_mb: list[float] = field(default_factory=list)  # GPU only


class Sampler:
    """Samples a device's utilisation on a background thread until :meth:`stop`."""

    def __init__(self, device: str) -> None:
        self.device, self.usage = device, Usage()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Usage:
        self._thread.start()
        return self.usage

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        previous = cpu_times()
        while not self._done.wait(PERIOD_S):
            if self.device == "cuda":
                busy, memory = gpu_sample()
                self.usage.busy.append(busy)
                self.usage.memory_mb.append(memory)
            else:
                now = cpu_times()
                self.usage.busy.append(cpu_busy(previous, now))
                previous = now


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from the first line of ``/proc/stat``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Per cent of all CPUs busy between two :func:`cpu_times` readings."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total else 0.0


def gpu_sample() -> tuple[float, float]:
    """(utilisation %, memory in use in MB) of GPU 0, from ``nvidia-smi``."""
    out = subprocess.run(
        [
            "nvidia-smi",
            "--id=0",
            "--query-gpu=utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    busy, memory = (float(v) for v in out.strip().split(","))
    return busy, memory


def most_at_once(rows: list[dict[str, Any]]) -> int:
    """The most trials whose training loops overlap at one moment."""
    events = sorted(
        [(r["train_started_at"], 1) for r in rows]
        + [(r["train_started_at"] + r["train_s"], -1) for r in rows]
    )
    running = best = 0
    for _, step in events:  # an end sorts before a start at the same moment
        running += step
        best = max(best, running)
    return best


def resources(device: str, cpus: int, share: int) -> dict[str, dict[str, float]]:
    """Each mode's per-trial resources: the whole device, or a 1/``share`` of it."""
    if device == "cuda":
        return {"one by one": {"cpu": 1, "gpu": 1}, "shared": {"cpu": 1, "gpu": 1 / share}}
    return {"one by one": {"cpu": cpus}, "shared": {"cpu": cpus / share}}


def summary(rows: list[dict[str, Any]], wall: float, usage: Usage) -> dict[str, Any]:
    return {
        "trials": len(rows),
        "wall_s": wall,
        "trials_per_hour": len(rows) * 3600 / wall,
        "train_s": sum(r["train_s"] for r in rows),
        "processes": len({r["pid"] for r in rows}),
        "at_once": most_at_once(rows),
        "util_pct": sum(usage.busy) / len(usage.busy) if usage.busy else float("nan"),
        "peak_mb": max(usage.memory_mb, default=float("nan")),
    }


def table(results: dict[str, dict[str, Any]], device: str) -> str:
    unit = "GPU" if device == "cuda" else "CPU"
    lines = [
        f"| mode | trials | processes | wall s | trials/h | Σ train s | at once | {unit} util % "
        "| peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in results.items():
        peak = "-" if math.isnan(s["peak_mb"]) else f"{s['peak_mb']:.0f}"
        lines.append(
            f"| {mode} | {s['trials']} | {s['processes']} | {s['wall_s']:.1f} | "
            f"{s['trials_per_hour']:.0f} | "
            f"{s['train_s']:.1f} | {s['at_once']} | {s['util_pct']:.0f} | {peak} |"
        )
    one, shared = results["one by one"], results["shared"]
    lines.append(
        f"\nshared / one by one: {shared['trials_per_hour'] / one['trials_per_hour']:.2f}× "
        "trials per hour"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if visible")
    parser.add_argument("--trials", type=int, help="per job (default: 8 on a GPU, 4 on CPU)")
    parser.add_argument("--share", type=int, help="trials at once (default: 4 per GPU; 2 CPUs)")
    parser.add_argument("--cpus", type=int, default=2, help="the head's CPUs on CPU (default 2)")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="digits", help="a builtin dataset")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if shutil.which("nvidia-smi") else "cpu")
    args.share = args.share or (4 if device == "cuda" else args.cpus)
    args.trials = args.trials or (8 if device == "cuda" else 4)
    results: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="dpt-share-"))
    try:
        with local_cluster() as cluster:
            if device == "cuda":
                cluster.start_head(num_cpus=max(args.share, 1), num_gpus=1)
            else:
                cluster.start_head(num_cpus=args.cpus)
            cluster.wait_for_nodes()
            with dptune_serve(cluster, work / "data", reuse=True) as client:
                r = client.post(
                    "/v1/datasets",
                    json={
                        "name": args.dataset,
                        "source": f"builtin:{args.dataset}",
                        "epsilon": 100.0,
                        "delta": 1e-5,
                    },
                )
                r.raise_for_status()
                for mode, asked in resources(device, args.cpus, args.share).items():
                    spec = job_spec(
                        r.json()["id"],
                        args.model,
                        args.epochs,
                        trials=args.trials,
                        resources=asked,
                        batch_size=args.batch_size,
                    )
                    with Sampler(device) as usage:
                        job_id, posted = run_job(client, spec, timeout=3600)
                        wall = time.time() - posted
                    results[mode] = summary(trial_timings(work / "data", job_id), wall, usage)
                    print(f"{mode}: {results[mode]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"device: {device}; {args.trials} trials of {args.model} on {args.dataset}, "
        f"{args.epochs} epochs, B = {args.batch_size}; shared: {args.share} at once\n"
    )
    print(table(results, device))
    return results


if __name__ == "__main__":
    main()
