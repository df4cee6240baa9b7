"""The general per-sample gradient path: ``torch.func`` functional_call + vmap(grad).

It materializes every example's gradient (memory B × #params), so it works for any model the
functional API can trace; the fast path (``workers.dp.ghost``) computes the same quantities
without materializing them where it can. Both implement the clipper seam
``clipped_grad_sum(model, loss_fn, inputs, targets, groups, coef_fn, out=None) -> (norms, sums)``
(``workers.dp.engine.Clipper``).

Each clipped sum is formed from the very per-sample gradients whose norms were taken, so an
example's contribution c·g_i has norm c·‖g_i‖ ≤ R_m: norms are float32 upper bounds that cover
the rounding of the factor and of the product (``workers.dp.bounds``), and an example contributes
zero to a group where its bound is not finite (invariant 9, see ``workers.dp.clipping``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from workers.dp import bounds
from workers.dp.clipping import (
    CoefFn,
    GroupSpec,
    add_clipped_sum,
    clip_factors,
    resolve_groups,
    zero_rows,
)

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
    """Upper bounds on ‖g_i restricted to group m‖₂ for every example i and group m, shape
    [B, M], float32 (``workers.dp.bounds.group_norms``)."""
    return torch.stack(
        [bounds.group_norms([bounds.row_norms(grads[n]) for n in group]) for group in groups], 1
    )


def clipped_grad_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    groups: list[list[str]],
    coef_fn: CoefFn,
    out: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """Per-sample norm bounds [B, M] (float32) and Σ_i coef[i, m(name)]·g_i[name] for every
    parameter, added into ``out`` when given (else into zeros); an example adds nothing to a
    group where its bound is not finite (factor 0, its gradients there zeroed)."""
    grads = per_sample_grads(model, loss_fn, inputs, targets)
    norms = group_norms(grads, groups)
    sums = out if out is not None else {name: torch.zeros_like(g[0]) for name, g in grads.items()}
    coef = clip_factors(coef_fn, norms).T.contiguous()  # [M, B]: a group's factors in order
    drop = (norms < math.inf).logical_not_().T.contiguous()  # [M, B]: not finite, NaN included
    for m, group in enumerate(groups):
        for name in group:
            g = grads.pop(name)  # one parameter at a time
            add_clipped_sum(sums[name], coef[m], zero_rows(g, drop[m]).detach())
    return norms, sums


def per_sample_grad_norms(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, groups: GroupSpec = None
) -> Tensor:
    """Public seam: per-sample gradient norms [B, M] for the groups of ``groups`` (any spec
    accepted by :func:`resolve_groups`, or already-resolved lists of full names)."""
    return group_norms(
        per_sample_grads(model, loss_fn, inputs, targets), resolve_groups(model, groups)
    )
