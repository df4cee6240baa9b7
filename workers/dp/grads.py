"""The general per-sample gradient path: ``torch.func`` functional_call + vmap(grad).

It materializes every example's gradient (memory B × #params), so it works for any model the
functional API can trace; the fast path (``workers.dp.ghost``) computes the same quantities
without materializing them where it can. Both implement the clipper seam
``clipped_grad_sum(model, loss_fn, inputs, targets, groups, coef_fn) -> (norms, sums)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from workers.dp.clipping import CoefFn, GroupSpec, resolve_groups

LossFn = Callable[[Tensor, Tensor], Tensor]


def per_sample_grads(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor
) -> dict[str, Tensor]:
    """Gradient of each example's loss w.r.t. each trainable parameter, shape [B, *param]."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def example_loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (params, frozen, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0)).sum()

    return vmap(grad(example_loss), in_dims=(None, 0, 0))(params, inputs, targets)


def group_norms(grads: dict[str, Tensor], groups: list[list[str]]) -> Tensor:
    """‖g_i restricted to group m‖₂ for every example i and group m, shape [B, M]."""
    squares = [sum(grads[n].flatten(1).pow(2).sum(1) for n in group) for group in groups]
    return torch.stack(squares, dim=1).sqrt()


def clipped_grad_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    groups: list[list[str]],
    coef_fn: CoefFn,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample norms [B, M] and Σ_i coef[i, m(name)]·g_i[name] for every parameter."""
    grads = per_sample_grads(model, loss_fn, inputs, targets)
    norms = group_norms(grads, groups)
    coef = coef_fn(norms)
    sums = {
        name: torch.tensordot(coef[:, m], grads[name], dims=1)
        for m, group in enumerate(groups)
        for name in group
    }
    return norms, sums


def per_sample_grad_norms(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, groups: GroupSpec = None
) -> Tensor:
    """Public seam: per-sample gradient norms [B, M] for the groups of ``groups`` (any spec
    accepted by :func:`resolve_groups`, or already-resolved lists of full names)."""
    return group_norms(per_sample_grads(model, loss_fn, inputs, targets),
                       resolve_groups(model, groups))
