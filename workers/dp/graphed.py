"""Micro-batches of a fixed shape, and on a GPU one CUDA graph that replays a clipper call.

Why: on a GPU the eager DP step is bound by the host, not by arithmetic: it launches many
small kernels (per layer: its norm, its hostile-row mask, its clipped sum), each costing
microseconds of Python and driver work for less GPU time (docs/performance.md). A CUDA graph
records the kernels of one clipper call — the forward pass, the one backward pass, the norms,
the clip factors and the clipped sums added into the gradient buffer — once, and launches all
of them again with one call (``torch.cuda.CUDAGraph.replay``).

A graph replays the same kernels on the same addresses, so :class:`Padded` gives it:

- **One shape.** Each micro-batch of n ≤ P examples is copied into buffers of P rows; rows
  n..P−1 hold zero inputs and the target cross-entropy ignores (``ignore_index``), so their loss
  is 0 with an exactly zero gradient: their output gradients ``∂L/∂s``, their per-sample
  gradients and their contribution to every clipped sum are exactly 0 (a finite factor times 0;
  zero inputs keep the forward pass finite). Unlike a mask multiplying the batch's losses, the
  target travels with its row, so the per-sample ``torch.func`` path sees it too. Only the first
  n norms are returned. The model must treat examples independently, as DP-SGD requires anyway
  (no batch norm), so the padding changes no real example's gradient.
- **Fixed addresses.** The engine's gradient buffer is allocated once per trial and parameters
  are updated in place; the clip factors' constants (the step's threshold C_t in them) are not
  baked into the kernels but read from device tensors the engine writes before each step
  (``workers.dp.clipping.factor_fn``), so an adaptive rule's trial is replayed too.
- **Nothing drawn, nothing synchronised.** The step's noise is in the buffer before the first
  call (the engine settles it), and a step makes no host synchronisation
  (``tests/workers/test_host_sync.py``), which capture would refuse.

The first ``WARM_UP`` calls run eagerly on a side stream (real micro-batches, added into the
real buffer), so that the math libraries pick their kernels before capture; the next call is
captured and replayed, and every later call is a replay. A micro-batch's step time then depends
on P alone, not on its realized size n (which is private: docs/design.md, invariant 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from workers.dp.clipping import CoefFn
from workers.dp.grads import LossFn

#: eager calls before capture (the PyTorch CUDA-graph notes warm up a few iterations)
WARM_UP = 3


@dataclass
class _Buffers:
    """The static inputs a recorded call reads: P rows of inputs and of targets."""

    inputs: Tensor
    targets: Tensor

    @classmethod
    def like(cls, inputs: Tensor, targets: Tensor, size: int) -> _Buffers:
        def empty(x: Tensor) -> Tensor:
            return torch.zeros((size, *x.shape[1:]), dtype=x.dtype, device=x.device)

        return cls(empty(inputs), empty(targets))

    def fill(self, inputs: Tensor, targets: Tensor, ignored: int) -> None:
        n = inputs.shape[0]
        self.inputs[:n].copy_(inputs)
        self.inputs[n:].zero_()
        self.targets[:n].copy_(targets)
        self.targets[n:].fill_(ignored)


class Padded:
    """A clipper (``workers.dp.engine.Clipper``) whose calls all have ``size`` rows; with
    ``graph`` (CUDA only), calls after the warm-up replay one recorded call. See the module."""

    def __init__(self, clipper: object, size: int, graph: bool) -> None:
        self.clipper, self.size, self.graph = clipper, size, graph
        self.buffers: _Buffers | None = None
        self.calls = 0
        #: the recorded call and the outputs each replay rewrites
        self.recorded: tuple[torch.cuda.CUDAGraph, tuple[Tensor, Mapping[str, Tensor]]] | None
        self.recorded = None

    def __call__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor,
        targets: Tensor,
        groups: list[list[str]],
        coef_fn: CoefFn,
        out: Mapping[str, Tensor] | None = None,
    ) -> tuple[Tensor, Mapping[str, Tensor]]:
        n = inputs.shape[0]
        if n > self.size:
            raise ValueError(f"a micro-batch of {n} examples exceeds the padded size {self.size}")
        if not isinstance(loss_fn, nn.CrossEntropyLoss) or loss_fn.reduction != "none":
            raise ValueError("loss_fn: padding needs per-sample cross-entropy (its ignore_index)")
        if self.buffers is None:
            self.buffers = _Buffers.like(inputs, targets, self.size)
        self.buffers.fill(inputs, targets, loss_fn.ignore_index)
        call = (model, loss_fn, self.buffers.inputs, self.buffers.targets, groups, coef_fn, out)
        self.calls += 1
        if not self.graph:
            norms, sums = self.clipper(*call)  # type: ignore[operator]
        elif self.recorded is not None:
            graph, (norms, sums) = self.recorded
            graph.replay()
        elif self.calls <= WARM_UP:
            norms, sums = self._warm_up(call)
        else:
            norms, sums = self._record(call)
        return norms[:n], sums

    def _warm_up(self, call: tuple) -> tuple[Tensor, Mapping[str, Tensor]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = self.clipper(*call)  # type: ignore[operator]
        torch.cuda.current_stream().wait_stream(side)
        return result

    def _record(self, call: tuple) -> tuple[Tensor, Mapping[str, Tensor]]:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = self.clipper(*call)  # type: ignore[operator]
        graph.replay()
        self.recorded = (graph, result)
        return result
