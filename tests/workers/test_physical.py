"""workers.dp.physical: a CPU trial's micro-batches halved while its steps fault pages in, then
the fastest size kept; nothing changes where nothing faults."""

from __future__ import annotations

import statistics

import torch

from core.config import ModelConfig
from workers.dp.physical import (
    FAULTS_PER_STEP,
    GAIN,
    JUDGED_STEPS,
    SETTLE_STEPS,
    PhysicalBatches,
)
from workers.models import build_model

PER_SIZE = SETTLE_STEPS + JUDGED_STEPS
MANY = 10 * FAULTS_PER_STEP


def _steps(physical: PhysicalBatches, batch: int, costs: dict[int, tuple[int, float]]) -> list[int]:
    """Run observed steps of ``batch`` examples until settled; ``costs``: per size, the page
    faults and seconds per example of its steps. The sizes the steps ran at."""
    sizes = []
    for _ in range(50):
        if physical.settled:
            break
        physical.split(torch.arange(batch))
        faults, per_example = costs[physical.size]
        sizes.append(physical.size)
        physical.observe(faults, per_example * batch, batch)
    assert physical.settled
    return sizes


def test_steps_that_fault_nothing_keep_the_configured_size() -> None:
    physical = PhysicalBatches(256, adapt=True)
    assert _steps(physical, 256, {256: (0, 1e-3)}) == [256] * PER_SIZE
    assert physical.size == 256


def test_halved_while_faulting_then_the_fastest_size_is_kept() -> None:
    # as measured for the transformer at B = 256: 128 barely pays, 64 faults nothing
    costs = {256: (238_000, 1.0), 128: (167_000, 0.9), 64: (0, 0.58)}
    physical = PhysicalBatches(256, adapt=True)
    assert _steps(physical, 256, costs) == [256] * PER_SIZE + [128] * PER_SIZE + [64] * PER_SIZE
    assert physical.size == 64


def test_back_to_the_configured_size_when_no_smaller_one_pays() -> None:
    # faults that no split removes (tensors of the model's size), and smaller splits are slower
    costs = {256: (MANY, 1.0), 128: (MANY, 1.0), 64: (MANY, 1.1), 32: (MANY, 1.3)}
    costs |= {16: (MANY, 1.6), 8: (MANY, 2.0)}
    physical = PhysicalBatches(256, adapt=True)
    assert _steps(physical, 256, costs)[-1] == 8  # down to the smallest size tried
    assert physical.size == 256


def test_a_gain_under_the_margin_is_not_taken() -> None:
    physical = PhysicalBatches(256, adapt=True)
    _steps(physical, 256, {256: (MANY, 1.0), 128: (0, 0.95)})
    assert physical.size == 256


def test_halving_starts_from_the_logical_batch_not_a_larger_limit() -> None:
    physical = PhysicalBatches(1024, adapt=True)
    sizes = _steps(physical, 40, {1024: (MANY, 1.0), 20: (MANY, 0.8), 10: (MANY, 0.7)})
    assert sorted(set(sizes), reverse=True) == [1024, 20, 10]  # 5 is under the smallest
    assert physical.size == 10


def test_off_cpu_nothing_is_measured_or_changed() -> None:
    physical = PhysicalBatches(256, adapt=False)
    for _ in range(3 * PER_SIZE):
        with physical.measure(256):
            pass
        physical.observe(MANY, 1.0, 256)
    assert physical.settled and physical.size == 256


def test_split_covers_the_batch_in_order() -> None:
    physical = PhysicalBatches(3, adapt=True)
    parts = physical.split(torch.arange(7))
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_real_step_with_attention_over_the_mmap_threshold_gets_smaller_micro_batches(
    make_step,
) -> None:
    """The product's step on a transformer whose attention scores are 64 MiB at B = 512
    (8 heads, 64 positions): glibc maps them afresh every step, so steps fault and are slow;
    the micro-batches shrink while they fault, and a smaller, faster size is kept (in a fresh
    process it is the one that faults no more; here earlier tests' heap may move it)."""
    batch = 512
    options = {"heads": 8, "dim": 32, "layers": 1, "ff": 32}
    model = build_model(ModelConfig(name="transformer", options=options), (8, 64), 4)
    step = make_step(model, noise=1.0, threshold=1.0, expected=batch, style="all_layer", lr=0.01)
    x, y = torch.randn(batch, 8, 64), torch.randint(0, 4, (batch,))
    physical = PhysicalBatches(batch, adapt=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a trial with one CPU
    try:
        for t in range(40):
            if physical.settled:
                break
            with physical.measure(batch):
                step.step([(x[i], y[i]) for i in physical.split(torch.arange(batch))], t)
    finally:
        torch.set_num_threads(threads)
    assert physical.settled
    tried = {j.size: j for j in physical.tried}
    assert min(tried[batch].faults) > FAULTS_PER_STEP
    assert physical.size < batch
    chosen = tried[physical.size]
    assert statistics.median(chosen.faults) < statistics.median(tried[batch].faults)
    assert chosen.cost < GAIN * tried[batch].cost
