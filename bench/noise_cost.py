"""What a step's Gaussian noise costs on one CPU core, stage by stage, and what the other
cryptographically secure generators at hand would cost instead, side by side in one run.

    python bench/noise_cost.py                        # mlp's and logreg's parameter counts
    python bench/noise_cost.py --sizes 1000000 --repeats 15

Rows (each the median of ``--repeats`` rounds; a round times every row once, in turn, so all
rows see the same machine):

- ``product``: :meth:`workers.dp.randomness.SecureStream.normal`, the noise every private step
  draws (Box–Muller in numpy on OpenSSL's AES-128-CTR keystream, 12 bytes a pair);
- ``keystream``: those bytes alone (:class:`core.entropy.Keystream`);
- ``transform``: the product's Box–Muller code alone, on bytes drawn beforehand (a copy of
  each chunk's, which the row includes);
- ``randomgen_aes``, ``chacha20``, ``chacha8``, ``speck128``: as many bytes from randomgen's
  AES-128-CTR (``AESCounter``, the generator behind ``core.entropy.secure_generator``), ChaCha
  with SIMD and SPECK-128, as the alternatives to OpenSSL's keystream;
- ``torch_box_muller``: the product's draw with its transform in torch's kernels: the same
  bytes, the same formula, torch's logarithm, sine and cosine (prices numpy's SIMD transform);
- ``randomgen_box_muller``: Box–Muller in torch on two 53-bit uniforms a pair from
  ``randomgen``'s AES-CTR (16 bytes a pair; prices the 12-byte pairs of the keystream);
- ``torch_randn``: torch's own ``normal_`` (mt19937, not secure: see ``workers.dp.randomness``),
  as the floor the secure noise is compared with.

The ratio column divides each row by ``product``. Threads: one (``torch.set_num_threads(1)``),
as a trial with one CPU runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from randomgen import SPECK128, AESCounter, ChaCha

from core.entropy import Keystream, Reader
from workers.dp.randomness import SecureStream
from workers.gaussian import CHUNK

#: parameter counts of two of ``bench/step_overhead.py``'s models: mlp and logreg
SIZES = [410_250, 2_350_335]


class _Given(Keystream):
    """A keystream drawn beforehand for the ``n`` float32 draws of a step: :meth:`SecureStream.
    normal` on it runs the product's Box–Muller code alone. Its readers copy the bytes drawn,
    as the product's readers write new ones (the transform overwrites its words)."""

    def __init__(self, n: int, key: bytes | None = None) -> None:
        super().__init__(key)
        pairs = sum((min(n - start, 2 * CHUNK) + 1) // 2 for start in range(0, n, 2 * CHUNK))
        # a step's draw claims as many bytes each time
        self.drawn = Keystream(self.key).read(0, 12 * pairs)

    def reader(self, start: int) -> Reader:
        return _GivenReader(self.drawn, start % len(self.drawn))


class _GivenReader(Reader):
    def __init__(self, drawn: np.ndarray, at: int) -> None:
        self.drawn, self.at = drawn, at

    def read(self, nbytes: int, into: np.ndarray) -> np.ndarray:
        into[:nbytes] = self.drawn[self.at : self.at + nbytes]
        self.at += nbytes
        return into[:nbytes]


def _raw(bit_generator: np.random.BitGenerator, nbytes: int) -> Callable[[], object]:
    return lambda: bit_generator.random_raw(-(-nbytes // 8))


def _randomgen_box_muller(n: int) -> Callable[[], object]:
    """Box–Muller on randomgen's uniforms: per chunk, the radii's 53-bit uniforms u₁ from
    ``randomgen``'s AES-CTR, then the angles' u₂; r = √(−2 ln(1 − u₁)), θ = 2πu₂ in float32."""
    generator, out = np.random.Generator(AESCounter()), torch.empty(n)

    def draw() -> None:
        for start in range(0, n, 2 * CHUNK):
            part = out[start : start + 2 * CHUNK]
            half = (len(part) + 1) // 2
            v = torch.from_numpy(generator.random(half)).neg_().add_(1.0)
            radius = v.float().log_().mul_(-2.0).sqrt_()
            angle = torch.from_numpy(generator.random(half)).float().mul_(2 * math.pi)
            torch.mul(radius, torch.cos(angle), out=part[:half])
            part[half:] = radius.mul_(angle.sin_())[: len(part) - half]

    return draw


def _torch_box_muller(n: int) -> Callable[[], object]:
    """The product's draw with its transform in torch's kernels: per
    chunk, the radii's 64-bit words, then the angles' 32-bit ones, from OpenSSL's keystream."""
    keystream, out = Keystream(), torch.empty(n)

    def words(nbytes: int, dtype: type) -> torch.Tensor:
        return torch.from_numpy(keystream.next(nbytes).view(dtype))

    def draw() -> None:
        for start in range(0, n, 2 * CHUNK):
            part = out[start : start + 2 * CHUNK]
            half = (len(part) + 1) // 2
            radius, sine = part[:half], part[half:]
            m = words(8 * half, np.int64).bitwise_right_shift_(11).add_(2**52 + 1)
            radius.copy_(m).mul_(2.0**-53).log_().mul_(-2.0).sqrt_()
            k = words(4 * half, np.int32).bitwise_right_shift_(8)
            angle = k.to(torch.float32).mul_(2 * math.pi * 2.0**-24)
            cosine = torch.cos(angle)
            torch.sin(angle[: len(sine)], out=sine).mul_(radius[: len(sine)])
            radius.mul_(cosine)

    return draw


def rows(n: int) -> dict[str, Callable[[], object]]:
    out = torch.empty(n)
    stream, given = SecureStream(), SecureStream()
    given.keystream = _Given(n)
    nbytes = 12 * sum((min(n - start, 2 * CHUNK) + 1) // 2 for start in range(0, n, 2 * CHUNK))
    keystream = Keystream()
    return {
        "product": lambda: stream.normal(n, out=out),
        "keystream": lambda: keystream.next(nbytes),
        "transform": lambda: given.normal(n, out=out),
        "randomgen_aes": _raw(AESCounter(), nbytes),
        "chacha20": _raw(ChaCha(rounds=20), nbytes),
        "chacha8": _raw(ChaCha(rounds=8), nbytes),
        "speck128": _raw(SPECK128(), nbytes),
        "torch_box_muller": _torch_box_muller(n),
        "randomgen_box_muller": _randomgen_box_muller(n),
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
