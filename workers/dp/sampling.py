"""Poisson sampling of logical batches and their split into physical micro-batches.

docs/design.md, invariant 1: each example joins each logical batch independently with probability
q = B/N, which is what the subsampled-Gaussian accountant assumes. The realized batch size is
random (possibly 0) and is never used to normalize: the engine divides the noisy sum by B.

q and T are fixed from the dataset's registered size N before any private validation split is
held out (``workers.trial``): the held-out examples are then never sampled (rate 0 ≤ q), so
the accountant's (q, σ, T) still bounds every example, and the trial costs exactly its plan.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from workers.dp.randomness import SecureStream


def poisson_batches(
    num_examples: int, rate: float, steps: int, stream: SecureStream
) -> Iterator[Tensor]:
    """Yield ``steps`` index tensors, each a Poisson sample of rate ``rate`` (may be empty),
    drawn from a secure stream with float64 comparisons (:meth:`SecureStream.bernoulli`)."""
    for _ in range(steps):
        yield stream.bernoulli(num_examples, rate).nonzero().squeeze(1)


def micro_batches(indices: Tensor, physical_batch_size: int) -> list[Tensor]:
    """Split one logical batch into chunks that fit in memory (gradient accumulation)."""
    return list(indices.split(physical_batch_size))
