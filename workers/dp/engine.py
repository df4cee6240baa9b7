"""One private optimisation step: clip, accumulate, add noise once, divide by B, step.

For a logical batch 𝓑_t (Poisson, expected size B) split into physical micro-batches, the
private gradient of every parameter is

    g̃ = (1/B) · ( Σ_{i∈𝓑_t} C(g_i^(m); C_t/√M)·g_i^(m) + N(0, σ_T²C_t²·I) )

(paper 001 eq. 2 / Algorithm 1, paper 002 eq. 4): the clipped sum has sensitivity C_t (≤ C_t
for add/remove, ≤ 2C_t for replace-one), the noise is drawn once per logical step whatever the
number of micro-batches, and the divisor is the expected B, never |𝓑_t| (docs/design.md,
invariant 1).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from core.config import ClippingFunction
from workers.dp.adaptive import ThresholdRule
from workers.dp.clipping import CoefFn, coefficient_fn
from workers.dp.grads import LossFn
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
        out: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


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
    ) -> None:
        self.model, self.loss_fn, self.groups, self.clipper = model, loss_fn, groups, clipper
        self.clipping, self.gamma, self.rule = clipping, gamma, rule
        self.grad_noise, self.expected_batch_size = grad_noise, expected_batch_size
        self.optimizer, self.noise = optimizer, noise
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        first = next(iter(self.params.values()))
        # One flat buffer holds every g̃ (parameters' ``.grad`` are views of it), allocated once
        # per trial: noise drawn into it, clipped sums added, one division for all. Its dtype
        # is the widest parameter dtype; a parameter of another dtype gets a converted copy.
        self.flat = torch.zeros(
            sum(p.numel() for p in self.params.values()),
            device=first.device,
            dtype=functools.reduce(torch.promote_types, (p.dtype for p in self.params.values())),
        )
        #: each parameter's part of the buffer, by name: what the clipper adds its sums into
        self.views = {
            name: view.view_as(p)
            for (name, p), view in zip(
                self.params.items(),
                self.flat.split([p.numel() for p in self.params.values()]),
                strict=True,
            )
        }

    def noise_std(self, threshold: float) -> float:
        """Per-coordinate std of the noise in the averaged gradient, σ_T·C_t/B."""
        return self.grad_noise * threshold / self.expected_batch_size

    def private_gradient(self, batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor:
        """Set ``p.grad`` to g̃ for one logical batch; return the per-example gradient norms
        ‖g_i‖ (all groups together), shape [|𝓑_t|]."""
        threshold = self.rule.threshold
        coef_fn = coefficient_fn(self.clipping, threshold, len(self.groups), self.gamma)
        # z is drawn straight into the buffer, then σ_T·C_t·z, the clipper adds each clipped
        # sum into it as soon as it is formed, then / B: no temporary of the model's size.
        self.noise.normal(self.flat.numel(), out=self.flat)
        self.flat.mul_(self.grad_noise * threshold)
        norms = [torch.zeros(0)]
        for inputs, targets in batches:
            if len(inputs) == 0:
                continue
            group_norms, _ = self.clipper(
                self.model, self.loss_fn, inputs, targets, self.groups, coef_fn, out=self.views
            )
            norms.append(group_norms.detach().pow(2).sum(1).sqrt().cpu())
        self.flat.div_(self.expected_batch_size)
        for p, view in zip(self.params.values(), self.views.values(), strict=True):
            p.grad = view if (view.dtype, view.device) == (p.dtype, p.device) else view.to(p)
        return torch.cat(norms)

    def step(self, batches: Iterable[tuple[Tensor, Tensor]], index: int) -> StepReport:
        """Private gradient, optimizer step, then the threshold rule's update for step t+1."""
        threshold = self.rule.threshold
        norms = self.private_gradient(batches)
        if isinstance(self.optimizer, AdamBC):
            self.optimizer.noise_std = self.noise_std(threshold)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.rule.update(norms, index)
        return StepReport(threshold=threshold, batch_size=len(norms))
