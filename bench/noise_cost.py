"""What a step's Gaussian noise costs on one CPU core, stage by stage, and what the other
cryptographically secure generators at hand would cost instead, side by side in one run.

    python bench/noise_cost.py                        # mlp's and logreg's parameter counts
    python bench/noise_cost.py --sizes 1000000 --repeats 15

Rows (each the median of ``--repeats`` rounds; a round times every row once, in turn, so all
rows see the same machine):

- ``product``: :meth:`workers.dp.randomness.SecureStream.normal`, the noise every private step
  draws (AES-128-CTR uniforms, Box–Muller in torch);
- ``aes_uniforms``: the AES-CTR uniforms alone, 53-bit, one per draw (``randomgen.AESCounter``
  with AES-NI where the CPU has it: the generator behind ``core.entropy.secure_generator``);
- ``transform``: the product's Box–Muller code alone, on uniforms already drawn;
- ``chacha20_uniforms``, ``chacha8_uniforms``, ``speck128_uniforms``: the same uniforms from
  randomgen's other secure generators (ChaCha with SIMD, SPECK-128), as the alternatives;
- ``torch_randn``: torch's own ``normal_`` (mt19937, not secure: see ``workers.dp.randomness``),
  as the floor the secure noise is compared with.

The ratio column divides each row by ``product``. Threads: one (``torch.set_num_threads(1)``),
as a trial with one CPU runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from randomgen import SPECK128, AESCounter, ChaCha

from workers.dp.randomness import CHUNK, SecureStream

#: parameter counts of two of ``bench/step_overhead.py``'s models: mlp and logreg
SIZES = [410_250, 2_350_335]


class _Given(SecureStream):
    """A stream whose uniforms were drawn beforehand: its ``normal`` runs the product's
    Box–Muller code alone. (That code forms 1 − u in place, so from round to round the radii's
    uniforms alternate between u and 1 − u; both are uniform, and the cost is the same.)"""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.drawn: list[torch.Tensor] = []
        for start in range(0, n, 2 * CHUNK):
            half = (min(n - start, 2 * CHUNK) + 1) // 2
            self.drawn += [super().uniform(half), super().uniform(half)]
        self.calls = 0

    def uniform(self, n: int) -> torch.Tensor:
        drawn = self.drawn[self.calls % len(self.drawn)]
        self.calls += 1
        assert len(drawn) == n, "the draws must come in the order they were made"
        return drawn


def _uniforms(bit_generator: np.random.BitGenerator, n: int) -> Callable[[], object]:
    generator = np.random.Generator(bit_generator)
    return lambda: generator.random(n)


def rows(n: int) -> dict[str, Callable[[], object]]:
    out = torch.empty(n)
    stream, given = SecureStream(), _Given(n)
    return {
        "product": lambda: stream.normal(n, out=out),
        "aes_uniforms": _uniforms(AESCounter(), n),
        "transform": lambda: given.normal(n, out=out),
        "chacha20_uniforms": _uniforms(ChaCha(rounds=20), n),
        "chacha8_uniforms": _uniforms(ChaCha(rounds=8), n),
        "speck128_uniforms": _uniforms(SPECK128(), n),
        "torch_randn": lambda: out.normal_(),
    }


def measure(n: int, repeats: int) -> dict[str, float]:
    """Median seconds of each row over ``repeats`` rounds (one warm-up round first)."""
    timed = rows(n)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for round_ in range(repeats + 1):
        for name, run in timed.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def table(results: dict[int, dict[str, float]]) -> str:
    lines = []
    for n, seconds in results.items():
        base = seconds["product"]
        lines += [f"\n{n:,} draws (one torch thread)", "| row | ms | / product |", "|---|---|---|"]
        lines += [
            f"| {name} | {1000 * value:.2f} | {value / base:.2f}× |"
            for name, value in seconds.items()
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=SIZES, help="draws per step")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {n: measure(n, args.repeats) for n in args.sizes}
    print(table(results))
    return results


if __name__ == "__main__":
    main()
