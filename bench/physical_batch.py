"""One logical DP step of B examples split into physical batches of B, B/2, B/4: time and page
faults per step, the splits taking turns in one process.

    python bench/physical_batch.py                        # transformer, mlp, cnn, logreg at B = 256
    python bench/physical_batch.py --models transformer --batch 64 --rounds 8
    python bench/physical_batch.py --trial     # whole transformer trials, adapting or not

Every split runs the product's step (``workers.dp.engine.PrivateStep``: fast clipper, noise from
the secure stream, SGD), with the micro-batches a trial makes of a logical batch larger than its
``training.physical_batch_size``; what the step computes is the same up to the order of float
additions. On CPU, torch's tensors come from glibc's ``malloc``, which maps every block over its
mmap threshold (at most 32 MiB) afresh and unmaps it when it is freed, so a step whose tensors
exceed it (the transformer's attention scores at B = 256: 64 MiB each) faults in and zeroes
their pages every step; smaller micro-batches keep them on the heap, where the next one reuses
them. ``faults`` is the median of the process's minor page faults per step (``ru_minflt``);
``time`` is each split's median step over the round's median step of one physical batch. A last
row per model runs what a CPU trial does (``workers.dp.physical.PhysicalBatches``: halve while
steps fault, keep the fastest) from one physical batch on, and prints the size it settled on
and the steps that took. ``--trial`` instead runs whole trials (``workers.trial.run_trial``) of
the transformer at B = 256 on random sequences (an ``npz`` file), with and without that choice,
taking turns, and prints their training times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import workers.trial  # noqa: E402
from core.config import ModelConfig, TrialConfig  # noqa: E402
from workers.dp.engine import PrivateStep  # noqa: E402
from workers.dp.ghost import clipped_grad_sum  # noqa: E402
from workers.dp.physical import PhysicalBatches, minor_faults  # noqa: E402
from workers.dp.randomness import SecureStream, spare_core  # noqa: E402
from workers.dp.sampling import micro_batches  # noqa: E402
from workers.models import build_model  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from step_overhead import MODELS, private_step  # noqa: E402


def _step(model_name: str, batch: int) -> tuple[PrivateStep, torch.Tensor, torch.Tensor]:
    shape, classes, options = MODELS[model_name]
    model = build_model(ModelConfig(name=model_name, options=options), shape, classes)
    private = private_step(
        model, clipped_grad_sum, batch, "all_layer", noise=SecureStream(), draw_ahead=spare_core()
    )
    return private, torch.randn(batch, *shape), torch.randint(0, classes, (batch,))


def measure(
    model_name: str, batch: int, rounds: int
) -> tuple[dict[int, dict[str, float]], tuple[int, int]]:
    """Per physical batch size: median step time over one physical batch's (``ratio``), its
    median seconds and median minor page faults per step; then the size a trial's
    ``PhysicalBatches`` settles on, and the steps it took to."""
    private, x, y = _step(model_name, batch)
    splits = sorted({batch, max(1, batch // 2), max(1, batch // 4)}, reverse=True)

    def run(physical: int) -> tuple[float, int]:
        parts = [(x[i], y[i]) for i in micro_batches(torch.arange(batch), physical)]
        faults, start = minor_faults(), time.perf_counter()
        private.step(parts, 0)
        seconds = time.perf_counter() - start
        if private.ahead is not None:  # the next draw, finished untimed (as in step_overhead)
            private.ahead.wait()
        return seconds, minor_faults() - faults

    for physical in splits:  # warm-up: first-use set-up of each shape
        run(physical)
        run(physical)
    seconds: dict[int, list[float]] = {p: [] for p in splits}
    faults: dict[int, list[int]] = {p: [] for p in splits}
    for _ in range(rounds):
        order = splits[:]
        random.shuffle(order)
        for physical in order:
            s, f = run(physical)
            seconds[physical].append(s)
            faults[physical].append(f)
    table = {
        p: {
            "ratio": statistics.median(
                s / whole for s, whole in zip(seconds[p], seconds[batch], strict=True)
            ),
            "seconds": statistics.median(seconds[p]),
            "faults": statistics.median(faults[p]),
        }
        for p in splits
    }
    physical, steps = PhysicalBatches(batch, adapt=True), 0
    while not physical.settled:
        with physical.measure(batch):
            private.step([(x[i], y[i]) for i in physical.split(torch.arange(batch))], steps)
        steps += 1
    return table, (physical.size, steps)


def trials(rounds: int, examples: int = 2048) -> dict[bool, list[tuple[float, int]]]:
    """Transformer trials at B = 256 (5 epochs of ``examples`` random sequences: 40 steps),
    adapting the micro-batches and not, taking turns: per setting, each trial's training
    seconds and the physical batch size it ended with."""
    adapting = workers.trial.PhysicalBatches
    out: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as folder:
        rng = np.random.default_rng()
        x = rng.standard_normal((examples, *MODELS["transformer"][0]), dtype=np.float32)
        y = (x[:, 0].mean(1) > 0).astype(np.int64)
        half = examples // 2  # a public validation split of as many
        np.savez(Path(folder) / "sequences.npz", x=x, y=y, x_val=x[:half], y_val=y[:half])
        cfg = TrialConfig.model_validate(
            {
                "dataset": {"source": f"npz:{folder}/sequences.npz", "num_classes": 2},
                "model": {"name": "transformer"},
                "epochs": 5,
                "batch_size": 256,
                "physical_batch_size": 256,
                "noise_multiplier": 1.0,
                "device": "cpu",
            }
        )
        for _ in range(rounds):
            for adapt in random.sample([True, False], 2):
                workers.trial.PhysicalBatches = (  # type: ignore[misc]
                    adapting if adapt else (lambda limit, adapt: adapting(limit, adapt=False))
                )
                try:
                    timings = workers.trial.run_trial(cfg).result["timings"]
                finally:
                    workers.trial.PhysicalBatches = adapting  # type: ignore[misc]
                out[adapt].append((timings["train_s"], timings["physical_batch_size"]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["transformer", "mlp", "cnn", "logreg"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trial", action="store_true", help="whole transformer trials instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.trial:
        runs = trials(args.rounds)
        fixed = statistics.median(s for s, _ in runs[False])
        for adapt, label in ((False, "one physical batch of 256"), (True, "the trial's choice")):
            seconds = statistics.median(s for s, _ in runs[adapt])
            sizes = sorted({size for _, size in runs[adapt]})
            print(
                f"transformer trial, B = 256, {label}: training {seconds:.1f} s "
                f"({seconds / fixed:.2f}x), physical batch {sizes}, {len(runs[adapt])} trials"
            )
        return
    print(f"device: cpu; threads: {args.threads}; B = {args.batch}; {args.rounds} rounds")
    print("| model | physical batch | step s | time / one physical batch | page faults a step |")
    print("|---|---|---|---|---|")
    for name in args.models:
        table, (chosen, steps) = measure(name, args.batch, args.rounds)
        for physical, row in table.items():
            print(
                f"| {name} | {physical} | {row['seconds']:.4f} | {row['ratio']:.2f}x "
                f"| {row['faults']:.0f} |",
                flush=True,
            )
        print(f"| {name} | trial's choice: **{chosen}** (after {steps} steps) | | | |", flush=True)


if __name__ == "__main__":
    main()
