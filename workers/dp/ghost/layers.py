"""Per-layer rules of the fast path: per-sample squared gradient norms and clipped sums.

Every rule sees, for one module, the inputs ``a`` it was called with and the gradients ``g`` of
the summed loss with respect to its outputs (``g_i = ∂L_i/∂s_i``: sample i's output depends on
sample i only). Paper 002, eq. 3 (book-keeping, Bu et al. 2022c): for a linear map ``s = a W``
the clipped sum over the batch is ``aᵀ · diag(C) · ∂L/∂s`` — one weighted matmul, with no
per-sample gradient and no second backward pass. The per-sample norm comes either from the ghost
norm (Li et al. 2021; Bu et al. 2022a)

    ‖∂L_i/∂W‖_F² = Σ_{t,s} (a_t·a_s)(g_t·g_s) = ⟨a_i a_iᵀ, g_i g_iᵀ⟩,    cost O(T²(d + p)),

or from instantiating ``∂L_i/∂W = g_iᵀ a_i`` (cost O(T·p·d)), chosen per layer as in FastDP's
mixed ghost norm (Bu et al. 2022c), here by cost (``use_ghost``). Convolutions are linear maps
on unfolded patches, an embedding is a linear map on one-hot rows, and the affine parameters of
LayerNorm / GroupNorm and all biases have small per-sample gradients, instantiated outright.

A module called several times in one forward (a shared layer) receives the sum of its calls'
gradients, so its calls are concatenated along the position axis T before any norm is taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Most float elements a transient tensor (unfolded patches, Gram matrices, instantiated
# per-sample weight gradients) may hold; larger batches are processed in chunks of samples.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class Call:
    """One invocation of a module in the forward pass: its input and its output gradient."""

    activation: Tensor
    grad: Tensor


def _chunks(batch: int, per_sample: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample))
    return [slice(i, min(i + step, batch)) for i in range(0, batch, step)]


def use_ghost(positions: int, d: int, p: int) -> bool:
    """Whether the ghost norm is cheaper than instantiating the per-sample gradient.

    Ghost: two T×T Gram matrices, T²(d + p) multiply-adds per sample; instantiation: T·p·d.
    FastDP's mixed rule compares the memory of the two instead (2T² ≤ p·d); here both are
    computed in bounded chunks of samples, so the flop count decides.
    """
    return positions * (d + p) <= p * d


def _cat(parts: Sequence[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim)


def matmul_sq_norms(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample ``‖g_iᵀ a_i‖_F²`` [B] for ``a`` [B, T, d] and ``g`` [B, T, p]: ghost norm or
    instantiated gradient (``use_ghost``), in chunks of samples to bound the transient memory."""
    batch, positions, d = a.shape
    p = g.shape[-1]
    if positions == 1:  # ‖g aᵀ‖² = ‖a‖²‖g‖² for a rank-one gradient
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    ghost = use_ghost(positions, d, p)
    out = []
    for part in _chunks(batch, positions * positions if ghost else p * d):
        ap, gp = a[part], g[part]
        if ghost:
            out.append((ap @ ap.mT).mul_(gp @ gp.mT).sum((1, 2)))
        else:
            out.append((gp.mT @ ap).square().sum((1, 2)))
    return _cat(out, 0).clamp_min_(0.0)


def _scaled(g: Tensor, coef: Tensor) -> Tensor:
    """``diag(C) · g``: sample i of ``g`` times ``coef[i]``."""
    return g * coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))


def _sum_over(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``x`` summed over ``dims`` (``Tensor.sum(())`` would reduce every axis instead)."""
    return x.sum(dims) if dims else x


def _rows(per_call: Sequence[Tensor]) -> Tensor:
    """Sum of the per-call per-sample gradients of one parameter (shared-layer calls add up)."""
    total = per_call[0]
    for part in per_call[1:]:
        total = total + part
    return total


def _trainable(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad


class LayerRule:
    """How the fast path treats one module type.

    ``small`` gives the instantiated per-sample gradients [B, *shape] of the parameters whose
    per-sample gradients are cheap (biases, affine norm parameters); subclasses with a weight
    matrix add ``weight_sq_norms`` / ``weight_sum`` / ``weight_per_sample`` for it.

    ``keeps_per_sample`` says when one call's per-sample gradients take less memory than its
    book-kept input and output gradient; the clipper then forms them as soon as the output
    gradient exists in the backward pass and drops both (FastDP's mixed book-keeping).
    """

    has_weight_matrix = False

    def fallback_reason(self, module: nn.Module) -> str | None:
        """None when this rule handles ``module``, else why it must fall back."""
        return None

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        raise NotImplementedError

    def weight_sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        raise NotImplementedError

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        raise NotImplementedError

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        raise NotImplementedError

    def keeps_per_sample(self, module: nn.Module, activation: Tensor,
                         output_shape: torch.Size) -> bool:
        return not self.has_weight_matrix

    def per_sample(self, module: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-sample gradients [B, *shape] of one call, for each trainable parameter."""
        out = self.small(module, [call])
        if self.has_weight_matrix and _trainable(module, "weight"):
            out["weight"] = self.weight_per_sample(module, call)
        return out

    def sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        """Per-sample squared gradient norm [B] of each trainable parameter, by attribute."""
        out = {k: v.flatten(1).square().sum(1) for k, v in self.small(module, calls).items()}
        if self.has_weight_matrix and _trainable(module, "weight"):
            out["weight"] = self.weight_sq_norms(module, calls)
        return out

    def sums(
        self, module: nn.Module, calls: Sequence[Call], coef: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """``Σ_i coef[k][i] · ∂L_i/∂param_k`` for each trainable parameter, by attribute."""
        out = {
            k: torch.tensordot(coef[k].to(v.dtype), v, dims=1)
            for k, v in self.small(module, calls).items()
        }
        if self.has_weight_matrix and _trainable(module, "weight"):
            out["weight"] = self.weight_sum(module, calls, coef["weight"])
        return out


def _bias_rows(module: nn.Module, calls: Sequence[Call], channel_dim: int) -> dict[str, Tensor]:
    """Per-sample bias gradient [B, p]: output gradients summed over every non-channel axis."""
    if not _trainable(module, "bias"):
        return {}
    per_call = []
    for call in calls:
        g = call.grad.movedim(channel_dim, -1)
        per_call.append(g.reshape(g.shape[0], -1, g.shape[-1]).sum(1))
    return {"bias": _rows(per_call)}


class LinearRule(LayerRule):
    """``nn.Linear`` on inputs [B, d] or [B, ..., d]; all middle axes count as positions."""

    has_weight_matrix = True

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        return _bias_rows(module, calls, -1)

    def weight_sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        def positions(x: Tensor) -> Tensor:
            return x.reshape(x.shape[0], -1, x.shape[-1])

        a = _cat([positions(c.activation) for c in calls], 1)
        g = _cat([positions(c.grad) for c in calls], 1)
        return matmul_sq_norms(a, g)

    def keeps_per_sample(self, module: nn.Module, activation: Tensor,
                         output_shape: torch.Size) -> bool:
        d, p = activation.shape[-1], output_shape[-1]
        positions = activation[0].numel() // d
        return positions > 1 and not use_ghost(positions, d, p)  # then p·d < T(d + p)

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        batch = call.grad.shape[0]
        g = call.grad.reshape(batch, -1, call.grad.shape[-1])
        return g.mT @ call.activation.reshape(batch, -1, call.activation.shape[-1])

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        return _rows([
            _scaled(c.grad, coef).reshape(-1, c.grad.shape[-1]).mT
            @ c.activation.reshape(-1, c.activation.shape[-1])
            for c in calls
        ])


class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` (any stride, dilation, groups, zero padding).

    A convolution is a linear map on the unfolded patches [B, C_in·k, T] (one per conv group).
    Norms take the ghost norm on those patches when it is cheaper, else instantiate per-sample
    gradients with one grouped weight-gradient convolution; clipped sums call the convolution's
    own weight-gradient kernel on ``diag(C)·g``.
    """

    has_weight_matrix = True

    def fallback_reason(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}"
        return None

    @staticmethod
    def _as_2d(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> tuple[Tensor, dict[str, tuple]]:
        """The input as a 4-D tensor (explicitly padded for string padding) and the geometry."""
        one_d = isinstance(module, nn.Conv1d)
        lift = (lambda v: (1, *v)) if one_d else (lambda v: tuple(v))
        x4 = x.unsqueeze(-2) if one_d else x
        if isinstance(module.padding, str):
            pads: list[int] = []
            for k, dil in zip(reversed(module.kernel_size), reversed(module.dilation), strict=True):
                total = dil * (k - 1) if module.padding == "same" else 0
                pads += [total // 2, total - total // 2]
            x4 = F.pad(x4, pads)
            padding = (0, 0)
        else:
            padding = (0, *module.padding) if one_d else tuple(module.padding)
        geometry = {
            "kernel_size": lift(module.kernel_size),
            "dilation": lift(module.dilation),
            "padding": padding,
            "stride": lift(module.stride),
        }
        return x4, geometry

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        return _bias_rows(module, calls, 1)

    @staticmethod
    def _ghost_cheaper(module: nn.Conv1d | nn.Conv2d, positions: int) -> bool:
        p, d = module.out_channels // module.groups, module.weight[0].numel()  # per conv group
        return use_ghost(positions, d, p)

    def keeps_per_sample(self, module: nn.Module, activation: Tensor,
                         output_shape: torch.Size) -> bool:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        output = math.prod(output_shape[1:])
        return (not self._ghost_cheaper(module, output // module.out_channels)
                and module.weight.numel() < activation[0].numel() + output)

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        return self._instantiated(module, [call], slice(None)).view(-1, *module.weight.shape)

    def weight_sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        groups = module.groups
        batch = calls[0].grad.shape[0]
        positions = sum(c.grad[0].numel() // module.out_channels for c in calls)
        p, d = module.out_channels // groups, module.weight[0].numel()  # per group
        ghost = self._ghost_cheaper(module, positions)
        per_sample = groups * (positions * (d + p) + (positions * positions if ghost else p * d))
        out = []
        for part in _chunks(batch, per_sample):
            if ghost:
                out.append(self._ghost(module, calls, part))
            else:
                out.append(self._instantiated(module, calls, part).flatten(1).square().sum(1))
        return _cat(out, 0)

    def _ghost(self, module: nn.Conv1d | nn.Conv2d, calls: Sequence[Call], part: slice) -> Tensor:
        """Ghost norm on the unfolded patches [b, C_in·k, T], one linear map per conv group."""
        patches, grads = [], []
        for call in calls:
            x4, geo = self._as_2d(module, call.activation[part])
            patches.append(F.unfold(x4, **geo))
            grads.append(call.grad[part].flatten(2))  # [b, C_out, T]
        a, g = _cat(patches, -1), _cat(grads, -1)
        b, positions, groups = a.shape[0], a.shape[-1], module.groups
        a = a.reshape(b * groups, -1, positions).mT
        g = g.reshape(b * groups, -1, positions).mT
        return matmul_sq_norms(a, g).view(b, groups).sum(1)

    def _instantiated(
        self, module: nn.Conv1d | nn.Conv2d, calls: Sequence[Call], part: slice
    ) -> Tensor:
        """Per-sample weight gradients [b, *weight] from one weight-gradient convolution with the
        samples as extra groups (faster than unfolding the patches)."""
        total = []
        for call in calls:
            x4, geo = self._as_2d(module, call.activation[part])
            g = call.grad[part]
            g4 = g.unsqueeze(-2) if isinstance(module, nn.Conv1d) else g
            b = x4.shape[0]
            shape = (b * module.out_channels, module.weight.shape[1], *geo["kernel_size"])
            total.append(torch.nn.grad.conv2d_weight(
                x4.reshape(1, -1, *x4.shape[2:]), shape, g4.reshape(1, -1, *g4.shape[2:]),
                geo["stride"], geo["padding"], geo["dilation"], b * module.groups,
            ).view(b, -1))
        return _rows(total)

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        total = []
        for call in calls:
            x4, geo = self._as_2d(module, call.activation)
            g = _scaled(call.grad, coef)
            g4 = g.unsqueeze(-2) if isinstance(module, nn.Conv1d) else g
            weight = module.weight.view(module.out_channels, -1, *geo["kernel_size"])
            total.append(torch.nn.grad.conv2d_weight(
                x4, weight.shape, g4, geo["stride"], geo["padding"], geo["dilation"],
                module.groups,
            ).view_as(module.weight))
        return _rows(total)


class EmbeddingRule(LayerRule):
    """``nn.Embedding``: row x_t of the weight receives g_t, so
    ``‖G_i‖² = Σ_{t,s} [x_t = x_s] g_t·g_s`` (the ghost norm with a one-hot activation);
    positions at ``padding_idx`` get no gradient."""

    has_weight_matrix = True

    def fallback_reason(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.Embedding)
        return "scale_grad_by_freq=True" if module.scale_grad_by_freq else None

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        return {}

    @staticmethod
    def _ids_and_grads(module: nn.Module, call: Call) -> tuple[Tensor, Tensor]:
        batch = call.grad.shape[0]
        ids = call.activation.reshape(batch, -1)
        g = call.grad.reshape(batch, ids.shape[1], -1)
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
        return ids, g

    def weight_sq_norms(self, module: nn.Module, calls: Sequence[Call]) -> Tensor:
        pairs = [self._ids_and_grads(module, c) for c in calls]
        ids = torch.cat([i for i, _ in pairs], 1)
        g = torch.cat([gr for _, gr in pairs], 1)
        batch, positions = ids.shape
        out = []
        for part in _chunks(batch, positions * positions):
            same = ids[part].unsqueeze(2) == ids[part].unsqueeze(1)
            gp = g[part]
            out.append((gp @ gp.mT).mul_(same).sum((1, 2)))
        return torch.cat(out).clamp_min_(0.0)

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        assert isinstance(module, nn.Embedding)
        total = torch.zeros_like(module.weight)
        for call in calls:
            ids, g = self._ids_and_grads(module, call)
            total.index_add_(0, ids.flatten(), _scaled(g, coef).flatten(0, 1))
        return total


class LayerNormRule(LayerRule):
    """``nn.LayerNorm``: y = x̂ ⊙ w + b; per-sample ∂L_i/∂w = Σ_t g_t ⊙ x̂_t, ∂L_i/∂b = Σ_t g_t."""

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        assert isinstance(module, nn.LayerNorm)
        k = len(module.normalized_shape)
        weight, bias = [], []
        for call in calls:
            x_hat = F.layer_norm(call.activation, module.normalized_shape, eps=module.eps)
            lead = tuple(range(1, call.grad.dim() - k))  # positions between batch and features
            weight.append(_sum_over(call.grad * x_hat, lead))
            bias.append(_sum_over(call.grad, lead))
        return _affine(module, weight, bias)


class GroupNormRule(LayerRule):
    """``nn.GroupNorm``: per-channel affine on x̂; sums run over the spatial axes."""

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        assert isinstance(module, nn.GroupNorm)
        weight, bias = [], []
        for call in calls:
            x_hat = F.group_norm(call.activation, module.num_groups, eps=module.eps)
            spatial = tuple(range(2, call.grad.dim()))
            weight.append(_sum_over(call.grad * x_hat, spatial))
            bias.append(_sum_over(call.grad, spatial))
        return _affine(module, weight, bias)


def _affine(module: nn.Module, weight: list[Tensor], bias: list[Tensor]) -> dict[str, Tensor]:
    out = {}
    if _trainable(module, "weight"):
        out["weight"] = _rows(weight)
    if _trainable(module, "bias"):
        out["bias"] = _rows(bias)
    return out


# Exact types only: a subclass may override ``forward`` and break the rule's assumptions.
RULES: dict[type[nn.Module], LayerRule] = {
    nn.Linear: LinearRule(),
    nn.Conv1d: ConvRule(),
    nn.Conv2d: ConvRule(),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.GroupNorm: GroupNormRule(),
}
