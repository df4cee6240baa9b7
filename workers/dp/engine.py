"""One private optimisation step: clip, accumulate, add noise once, scale by C_t/B, step.

For a logical batch 𝓑_t (Poisson, expected size B) split into physical micro-batches, the
private gradient of every parameter is

    g̃ = (C_t/B) · ( Σ_{i∈𝓑_t} c̃_i^(m)·g_i^(m) + σ_T·z ),   z ~ N(0, I),

with c̃ = C(g; C_t/√M)/C_t, the clip factor in units of the clip bound (paper 001 eq. 2 /
Algorithm 1, paper 002 eq. 4, with C_t taken out of the sum and its noise): every contribution
c̃ᵢgᵢ has norm ≤ 1, so the sum has sensitivity 1 (≤ 2 for replace-one) and noise of std σ_T
whatever the threshold. The noise is drawn once per logical step whatever the number of
micro-batches, and the divisor is the expected B, never |𝓑_t| (docs/design.md, invariant 1).

The scale comes last (docs/design.md, invariant 12): noise and contributions are added while
both are of order 1, normal float32 numbers for every admitted σ_T (``core.config.NOISE``),
and one pass over the buffer multiplies their sum by C_t/B after the last micro-batch. Scaled
first, a tiny C_t/B rounds the noise to 0 while a record's contribution still rounds to a
subnormal; scaled last, whatever rounding does is post-processing of the noisy sum. The
gradient buffer gets σ_T·z, drawn into it, then each clipped sum as soon as it is formed (no
temporary of the model's size), then the scale.

On CPU the noise of step t + 1 may be drawn ahead (``draw_ahead``) on a core that torch's threads
leave free: a model-sized draw from the AES-CTR stream costs as much as a whole non-private step of
a small model (docs/performance.md, "What the numbers say"). A
:class:`~workers.dp.randomness.NoiseChild` draws it, in a process of its own and from a keystream of
its own, into the gradient buffer itself, which the two processes share (no second model-sized
buffer): from the end of step t (once the optimizer has read g̃_t) until step t + 1 first adds a
clipped sum, which waits for it (:class:`_AfterDraw`). Until the child has started, and for a stream
whose draws a subclass changes, the noise is drawn in line. Nothing the guarantee rests on changes:
z_{t+1} is the child's next draw, made from its key and σ_T alone (before, and independent of, the
data), used by step t + 1 alone, of std σ_T as in line whatever C_{t+1} is (the threshold scales
only the finished sum); a draw left over when training stops is never used.

No host synchronisation: norms stay on the model's device, and with a fixed threshold nothing
leaves it during a step (``tests/workers/test_host_sync.py``); a rule that looks at the norms
takes them to the host once, after the optimizer step (:mod:`workers.dp.adaptive`). Given
``padded_rows``, every micro-batch is padded to that many rows, the step's C_t is written to
the device before its first call, and on a GPU the clipper calls replay one CUDA graph
(:mod:`workers.dp.graphed`); the noise is then put in the buffer before the first call, since a
recorded call cannot draw it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from core.config import ClippingFunction
from workers.dp.adaptive import ThresholdRule
from workers.dp.clipping import CoefFn, coefficient_fn, factor_fn, group_thresholds
from workers.dp.grads import LossFn
from workers.dp.graphed import Padded
from workers.dp.optim import AdamBC, Optimizer
from workers.dp.randomness import SecureStream


class Clipper(Protocol):
    """The clipper seam: per-sample norms [B, M] (float64) and, for every trainable parameter,
    Σ_i coef[i, m] · g_i clipped per group by ``coef_fn`` — added into ``out`` when it is given
    (views of the engine's gradient buffer: no model-sized temporary), else into fresh zeros;
    the sums are returned either way."""

    def __call__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor,
        targets: Tensor,
        groups: list[list[str]],
        coef_fn: CoefFn,
        out: Mapping[str, Tensor] | None = None,
    ) -> tuple[Tensor, Mapping[str, Tensor]]: ...


class _AfterDraw(Mapping[str, Tensor]):
    """The views of the gradient buffer as the clipper's ``out``: the first one asked for waits
    until ``ready`` has put the step's noise in the buffer (drawn in line, or ahead: see the
    module), so no sum is added before it."""

    def __init__(self, views: dict[str, Tensor], ready: Callable[[], None]) -> None:
        self._views, self._ready = views, ready

    def settle(self) -> None:
        """Make sure the noise is in (a step whose batches added nothing needs it too)."""
        if self._ready is not None:
            ready, self._ready = self._ready, None
            ready()

    def __getitem__(self, name: str) -> Tensor:
        self.settle()
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


@dataclass(frozen=True)
class StepReport:
    threshold: float  # C_t used to clip this step (a DP output: data-independent or post-processed)
    batch_size: int  # realized |𝓑_t|: private, operator-only


class PrivateStep:
    """Holds what stays fixed during a trial and performs logical steps with :meth:`step`."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        groups: list[list[str]],
        clipper: Clipper,
        *,
        clipping: ClippingFunction,
        gamma: float,
        rule: ThresholdRule,
        grad_noise: float,
        expected_batch_size: int,
        optimizer: Optimizer,
        noise: SecureStream,
        draw_ahead: bool = False,
        padded_rows: int | None = None,
    ) -> None:
        self.model, self.loss_fn, self.groups, self.clipper = model, loss_fn, groups, clipper
        self.clipping, self.gamma, self.rule = clipping, gamma, rule
        self.grad_noise, self.expected_batch_size = grad_noise, expected_batch_size
        self.optimizer, self.noise = optimizer, noise
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        device = next(iter(self.params.values())).device
        # One flat buffer holds every g̃ (parameters' ``.grad`` are views of it), allocated once
        # per trial: noise drawn into it, clipped sums added, one scaling for all. Its dtype
        # is the widest parameter dtype; a parameter of another dtype gets a converted copy.
        size = sum(p.numel() for p in self.params.values())
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params.values()))
        #: the child drawing ahead into ``flat`` (see the module; CUDA draws on the device)
        self.ahead = noise.child(size, dtype) if draw_ahead and device.type == "cpu" else None
        self.flat = (
            self.ahead.flat
            if self.ahead is not None
            else torch.zeros(size, device=device, dtype=dtype)
        )
        #: each parameter's part of the buffer, by name: what the clipper adds its sums into
        self.views = self._views(self.flat)
        #: whether the child is drawing the next step's noise
        self.drawing = False
        #: whether clipper calls replay a CUDA graph (see the module)
        self.graphed = padded_rows is not None and device.type == "cuda"
        #: with ``padded_rows``, the clip factors' constants R_m and R_m/C_t on the device,
        #: written before each step, and the trial's one clip-factor function, which reads
        #: them at each call (a recorded call then reads the step's, whatever the rule)
        self.on_device: tuple[Tensor, CoefFn] | None = None
        if padded_rows is not None:
            self.clipper = Padded(clipper, padded_rows, graph=self.graphed)
            constants = torch.zeros(2, dtype=torch.float32, device=device)
            self.on_device = (constants, factor_fn(clipping, *constants.unbind(), gamma))

    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        sizes = [p.numel() for p in self.params.values()]
        return {
            name: view.view_as(p)
            for (name, p), view in zip(self.params.items(), flat.split(sizes), strict=True)
        }

    def noise_std(self, threshold: float) -> float:
        """Per-coordinate std of the noise in g̃, σ_T·C_t/B (DP-AdamBC's bias correction)."""
        return self.grad_noise * threshold / self.expected_batch_size

    def private_gradient(self, batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor:
        """Set ``p.grad`` to g̃ for one logical batch; return the per-example gradient norms
        ‖g_i‖ (all groups together), shape [|𝓑_t|], on the model's device."""
        threshold = self.rule.threshold
        # σ_T·z is drawn straight into the buffer (ahead, or when the first sum is due), the
        # clipper adds each clipped sum, its factors divided by C_t, into it as soon as it is
        # formed, and the total is scaled by C_t/B once (see the module).
        coef_fn = self._coef_fn(threshold)
        out = _AfterDraw(self.views, self._noise)
        if self.graphed:
            out.settle()
        norms: list[Tensor] = []
        for inputs, targets in batches:
            if len(inputs) == 0:
                continue
            group_norms, _ = self.clipper(
                self.model, self.loss_fn, inputs, targets, self.groups, coef_fn, out=out
            )
            norms.append(_example_norms(group_norms.detach()))
        out.settle()
        self.flat.mul_(threshold / self.expected_batch_size)
        for p, view in zip(self.params.values(), self.views.values(), strict=True):
            p.grad = view if (view.dtype, view.device) == (p.dtype, p.device) else view.to(p)
        if len(norms) == 1:
            return norms[0]
        return torch.cat(norms) if norms else torch.zeros(0, device=self.flat.device)

    def _coef_fn(self, threshold: float) -> CoefFn:
        """The clip factors at C_t = ``threshold``, divided by it (see the module)."""
        if self.on_device is None:
            return coefficient_fn(
                self.clipping, threshold, len(self.groups), self.gamma, 1 / threshold
            )
        constants, coef_fn = self.on_device
        r = group_thresholds(threshold, len(self.groups))
        for slot, value in enumerate((r, r / threshold)):
            constants[slot].fill_(value)  # a launch with the value as argument: no sync
        return coef_fn

    def _noise(self) -> None:
        """Put this step's noise σ_T·z in ``flat``: the child's draw (asked for now if it was
        not yet; a failed one raises here), or, until the child has started, one made here."""
        if self.ahead is not None and (self.drawing or self.ahead.ready()):
            if not self.drawing:
                self.ahead.request(self.grad_noise)
            self.drawing = False
            self.ahead.wait()
            return
        self.noise.normal(self.flat.numel(), out=self.flat, scale=self.grad_noise)

    def step(self, batches: Iterable[tuple[Tensor, Tensor]], index: int) -> StepReport:
        """Private gradient, optimizer step, then the threshold rule's update for step t+1;
        drawing ahead, the next step's noise is asked for once the optimizer has read the
        gradient."""
        threshold = self.rule.threshold
        norms = self.private_gradient(batches)
        if isinstance(self.optimizer, AdamBC):
            self.optimizer.noise_std = self.noise_std(threshold)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.rule.update(norms, index)
        if self.ahead is not None and self.ahead.ready():
            self.ahead.request(self.grad_noise)
            self.drawing = True
        return StepReport(threshold=threshold, batch_size=len(norms))


def _example_norms(group_norms: Tensor) -> Tensor:
    """Each example's norm over all groups [B] from its group norms [B, M]: with one group,
    that group's (a view, no operation)."""
    if group_norms.shape[1] == 1:
        return group_norms[:, 0]
    return torch.linalg.vector_norm(group_norms, dim=1)
