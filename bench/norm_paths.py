"""The product's DP step with large inputs' squared norms summed in float32 blocks (bounded from
above: ``workers.dp.clipping.sq_norms``) against the same step with every norm summed in
float64, alternating in one process.

    python bench/norm_paths.py                      # mlp and logreg, B = 64 and 256
    python bench/norm_paths.py --models cnn --batches 256 --rounds 20

For each (model, batch) one step is built as ``bench/step_overhead.py`` builds its ``fast``
column (all-layer Abadi clipping, noise drawn ahead when a core is spare, one torch thread),
then ``--rounds`` rounds each time a few steps with every norm in float64
(``BLOCKS_ABOVE`` raised past any input) and a few with the product's setting, in turn. Each
round keeps the median of its steps; the table gives the median of those per path and their
ratio. Alternating in one process puts both paths on the same machine state; the fresh
processes of ``step_overhead.py`` moved by more than this change on a loaded machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_overhead: the step it times
from step_overhead import _build_step

from workers.dp import clipping

PATHS = {"float64": sys.maxsize, "float32 blocks": clipping.BLOCKS_ABOVE}


def measure(model: str, batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Median step seconds of each path over ``rounds`` alternating rounds."""
    step = _build_step(model, batch, "fast", "cpu", "all_layer")
    for _ in range(3):
        step()
    medians: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        for _ in range(rounds):
            for path, above in PATHS.items():
                clipping.BLOCKS_ABOVE = above
                times = []
                for _ in range(steps):
                    started = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - started)
                medians[path].append(statistics.median(times))
    finally:
        clipping.BLOCKS_ABOVE = PATHS["float32 blocks"]
    return {path: statistics.median(values) for path, values in medians.items()}


def main(argv: list[str] | None = None) -> dict[tuple[str, int], dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "logreg"])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6, help="steps per path in a round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    print("| model | B | float64: ms | float32 blocks: ms | blocks / float64 |")
    print("|---|---|---|---|---|")
    for model in args.models:
        for batch in args.batches:
            got = measure(model, batch, args.rounds, args.steps)
            results[(model, batch)] = got
            before, after = got["float64"], got["float32 blocks"]
            print(
                f"| {model} | {batch} | {1000 * before:.2f} | {1000 * after:.2f} | "
                f"{after / before:.3f} |",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
