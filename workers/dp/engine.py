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

On CPU the noise of step t + 1 may be drawn ahead (``draw_ahead``) on a core that torch's
threads leave free: a model-sized draw from the AES-CTR stream costs as much as a whole
non-private step of a small model (issue 15). It is drawn into the gradient buffer itself (no
second model-sized buffer), from the end of step t (once the optimizer has read g̃_t) until
step t + 1 first adds a clipped sum: it overlaps whatever the trial does between steps and
step t + 1's forward pass, backward pass and norms, and the clipper's first sum waits for it
(:class:`_AfterDraw`), making the draw's chunks that nobody has begun meanwhile
(``workers.dp.randomness.Drawing``: the same bits, each chunk from its own place in the
keystream). The draw is made in the trial's noise process (``workers.noise_process``), into
the buffer, which is memory the two processes share, so that it does not take turns with the
step on Python's GIL. Nothing the guarantee rests on changes: z_{t+1} is the stream's next
draw, used by step t + 1 alone, of std σ_T as in line whatever C_{t+1} is (the threshold
scales only the finished sum); a draw left over when training stops is never used.
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
from workers.dp.clipping import CoefFn, coefficient_fn
from workers.dp.grads import LossFn
from workers.dp.optim import AdamBC, Optimizer
from workers.dp.randomness import Drawing, SecureStream, noise_buffer


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
    until ``ready`` has put the step's noise in the buffer (the draw made beside the
    step, see the module), so no sum is added before it."""

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
    ) -> None:
        self.model, self.loss_fn, self.groups, self.clipper = model, loss_fn, groups, clipper
        self.clipping, self.gamma, self.rule = clipping, gamma, rule
        self.grad_noise, self.expected_batch_size = grad_noise, expected_batch_size
        self.optimizer, self.noise = optimizer, noise
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        device = next(iter(self.params.values())).device
        #: drawing ahead into ``flat`` (see the module; CUDA draws on the device anyway)
        self.draw_ahead = draw_ahead and device.type == "cpu"
        # One flat buffer holds every g̃ (parameters' ``.grad`` are views of it), allocated once
        # per trial: noise drawn into it, clipped sums added, one scaling for all. Its dtype
        # is the widest parameter dtype; a parameter of another dtype gets a converted copy.
        size = sum(p.numel() for p in self.params.values())
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params.values()))
        self.flat = (
            noise_buffer(size, dtype)
            if self.draw_ahead
            else torch.zeros(size, device=device, dtype=dtype)
        )
        #: each parameter's part of the buffer, by name: what the clipper adds its sums into
        self.views = self._views(self.flat)
        #: the next step's noise being drawn ahead
        self.ahead: Drawing | None = None

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
        ‖g_i‖ (all groups together), shape [|𝓑_t|]."""
        threshold = self.rule.threshold
        # σ_T·z is drawn straight into the buffer (ahead, or when the first sum is due), the
        # clipper adds each clipped sum, its factors divided by C_t, into it as soon as it is
        # formed, and the total is scaled by C_t/B once (see the module).
        coef_fn = coefficient_fn(
            self.clipping, threshold, len(self.groups), self.gamma, 1 / threshold
        )
        if self.draw_ahead and self.ahead is None:
            self._draw_ahead()
        out = _AfterDraw(self.views, self._noise)
        norms: list[Tensor] = []
        for inputs, targets in batches:
            if len(inputs) == 0:
                continue
            group_norms, _ = self.clipper(
                self.model, self.loss_fn, inputs, targets, self.groups, coef_fn, out=out
            )
            norms.append(torch.linalg.vector_norm(group_norms.detach(), dim=1).cpu())
        out.settle()
        self.flat.mul_(threshold / self.expected_batch_size)
        for p, view in zip(self.params.values(), self.views.values(), strict=True):
            p.grad = view if (view.dtype, view.device) == (p.dtype, p.device) else view.to(p)
        return torch.cat(norms) if len(norms) > 1 else (norms[0] if norms else torch.zeros(0))

    def _draw_ahead(self) -> None:
        """Start drawing the next step's noise σ_T·z."""
        self.ahead = self.noise.normal_ahead(self.flat, self.grad_noise)

    def _noise(self) -> None:
        """Put this step's noise σ_T·z in ``flat``: the draw made ahead (a failed one raises
        here), or one made now."""
        if self.ahead is None:
            self.noise.normal(self.flat.numel(), out=self.flat, scale=self.grad_noise)
            return
        ahead, self.ahead = self.ahead, None
        ahead.result()

    def step(self, batches: Iterable[tuple[Tensor, Tensor]], index: int) -> StepReport:
        """Private gradient, optimizer step, then the threshold rule's update for step t+1;
        drawing ahead, the next step's noise starts once the optimizer has read the gradient."""
        threshold = self.rule.threshold
        norms = self.private_gradient(batches)
        if isinstance(self.optimizer, AdamBC):
            self.optimizer.noise_std = self.noise_std(threshold)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.rule.update(norms, index)
        if self.draw_ahead:
            self._draw_ahead()
        return StepReport(threshold=threshold, batch_size=len(norms))
