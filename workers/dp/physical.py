"""The physical batch size of a CPU trial: halved while that makes its steps faster.

A logical batch is split into physical micro-batches of at most ``physical_batch_size``
examples (``workers.dp.sampling.micro_batches``); the engine adds their clipped sums and draws
one noise, so the split changes what a step costs, never what it computes (up to the order of
float additions).

On CPU the split matters beyond memory. torch's tensors come from glibc's ``malloc``, which
maps each block above its mmap threshold (at most 32 MiB) afresh and unmaps it when freed; a
step's tensors are freed and made again every step, so each tensor over the threshold has all
its pages faulted in and zeroed by the kernel every step. A step with such tensors (the
transformer's attention scores at B = 256 are 64 MiB) spends much of its time in page faults,
and in smaller micro-batches its tensors stay on the heap and nothing faults; a step that
faults nothing is only slower in smaller micro-batches (more per-call work). Keeping freed
blocks in the heap instead (``mallopt``) lets the heap keep growing under Poisson batch
sizes. Measurements: docs/performance.md, "Micro-batches on CPU" (``bench/physical_batch.py``).

:class:`PhysicalBatches` therefore starts at the configured size and, while steps fault more
than ``FAULTS_PER_STEP`` pages, tries half the size, down to ``SMALLEST`` (a tensor can fault
until it is under the threshold, so one halving that does not pay says little about the
next); then it keeps the size whose steps took the least time per example, the configured one
unless another beat it by ``GAIN``. A choice depends on the machine and on the realized batch
sizes, which are operator-only, so the size chosen is reported with the trial's timings alone
(docs/design.md, invariant 4); the released model depends on it only through the rounding of
sums, and a step's duration depends on the realized size anyway.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import Tensor

from workers.dp.sampling import micro_batches

#: minor page faults a steady step may take (64 MiB of fresh pages) before half the size is tried
FAULTS_PER_STEP = 16_384
#: steps at a new size that are not judged (the first ones grow the heap to the new shapes)
SETTLE_STEPS = 1
#: steps judged at each size (their medians decide)
JUDGED_STEPS = 3
#: another size is kept when its median time per example is below GAIN × the configured size's
GAIN = 0.9
#: the smallest physical batch size tried
SMALLEST = 8


@dataclass
class Judged:
    """One size's judged steps: page faults, and seconds per example."""

    size: int
    faults: list[int] = field(default_factory=list)
    per_example: list[float] = field(default_factory=list)
    seen: int = 0  # steps at this size, settling ones included

    @property
    def cost(self) -> float:
        return statistics.median(self.per_example)


class PhysicalBatches:
    """Splits logical batches into micro-batches of :attr:`size`, which :meth:`observe` may
    change (``adapt``: on CPU) as the module explains, until it is :attr:`settled`."""

    def __init__(self, limit: int, *, adapt: bool) -> None:
        self.size = limit
        self.settled = not adapt
        #: every size tried, with its judged steps, the current one last
        self.tried = [Judged(limit)]
        self._largest_batch = 0

    def split(self, indices: Tensor) -> list[Tensor]:
        """The micro-batches of one logical batch (index tensors)."""
        self._largest_batch = max(self._largest_batch, len(indices))
        return micro_batches(indices, self.size)

    @contextlib.contextmanager
    def measure(self, examples: int) -> Iterator[None]:
        """Around one step of ``examples`` examples: its page faults and time, observed."""
        if self.settled or examples == 0:
            yield
            return
        faults, started = minor_faults(), time.perf_counter()
        yield
        self.observe(minor_faults() - faults, time.perf_counter() - started, examples)

    def observe(self, faults: int, seconds: float, examples: int) -> None:
        """One step's page faults, seconds and example count, at the current size."""
        if self.settled:
            return
        judged = self.tried[-1]
        judged.seen += 1
        if judged.seen <= SETTLE_STEPS:
            return
        judged.faults.append(faults)
        judged.per_example.append(seconds / examples)
        if len(judged.faults) < JUDGED_STEPS:
            return
        smaller = min(judged.size, self._largest_batch) // 2
        if statistics.median(judged.faults) > FAULTS_PER_STEP and smaller >= SMALLEST:
            self.tried.append(Judged(smaller))
            self.size = smaller
            return
        configured, *others = self.tried
        best = min(others, key=lambda j: j.cost, default=configured)
        self.size = best.size if best.cost < GAIN * configured.cost else configured.size
        self.settled = True


def minor_faults() -> int:
    """The process's minor page faults so far (pages the kernel mapped in on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
