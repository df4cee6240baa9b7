"""The sampling schedule of a trial: q = B/N and T, as the planner and the engine both compute
them from the registered N (docs/design.md, invariant 1), so planned and trained steps agree."""

from __future__ import annotations


def sample_rate(expected_batch_size: int, num_examples: int) -> float:
    if expected_batch_size > num_examples:
        raise ValueError(
            f"batch_size: expected batch size {expected_batch_size} exceeds the "
            f"{num_examples} training examples"
        )
    return expected_batch_size / num_examples


def num_steps(num_examples: int, expected_batch_size: int, epochs: float) -> int:
    """T = epochs·N/B = epochs/q logical steps (at least one). The service's planner calls this
    with the registered N, so planned and trained step counts agree."""
    return max(1, round(epochs * num_examples / expected_batch_size))
