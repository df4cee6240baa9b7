"""Per-layer rules of the fast path: bounds on per-sample gradient norms, and clipped sums.

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

Floating point. Every norm is a float32 upper bound (``workers.dp.bounds``: the error analysis).
The clipped sum of a weight matrix is not formed from the per-sample gradient whose norm is
taken, so the bound must also cover what the sum adds for an example (docs/design.md,
invariant 9: never more than its clipping bound). With
one position (T = 1) the gradient g aᵀ is rank one: its norm is ‖a‖·‖g‖ (no cancellation) and
each entry of its contribution is two products. With T > 1 positions, Σ_t g_t a_tᵀ can cancel;
there the norm gets a rounding guard (``positions_norms``) that makes the argument rigorous.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.dp import bounds
from workers.dp.bounds import Bound

# Most float elements a transient tensor (unfolded patches, Gram matrices, instantiated
# per-sample weight gradients) may hold; larger batches are processed in chunks of samples.
CHUNK_ELEMENTS = 1 << 24
# Most (sample, position) rows one book-keeping product adds up (a sample with more positions is
# reduced alone): this bounds the n of the sum's rounding error, see ``positions_norms``.
SUM_ROWS = 1 << 12
# Most elements of the patches one batched matmul of per-sample convolution gradients copies at
# once (``_matmul_per_sample``): a few samples, about a megabyte in float32.
PATCH_CHUNK = 1 << 18

# Timed runs of each way to form a geometry's per-sample convolution gradients before the
# faster one is kept (``_Faster``).
TIMED_RUNS = 2

PerSampleConv = Callable[[Tensor, Tensor, dict[str, tuple], int, torch.Size], Tensor]


@dataclass
class Call:
    """One invocation of a module in the forward pass: its input, its output gradient, and what
    its forward computed that the rule reuses (``LayerRule.saved``)."""

    activation: Tensor
    grad: Tensor
    saved: Any = None


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


def _sum_rows(positions: int) -> int:
    """The most (sample, position) rows one chunk of ``_sum_chunks`` may add up, whatever the
    batch: an example's norm bound, and so its clip factor, must not depend on the other
    examples (nor on how many there are), or adding one record would change the others'
    contributions."""
    return max(positions, SUM_ROWS)


def _sum_chunks(batch: int, positions: int, elements: int) -> list[slice]:
    """Chunks of samples for a book-keeping sum: bounded copies of a sample's inputs and output
    gradients (``elements`` of them a sample) and at most max(T, ``SUM_ROWS``) (sample, position)
    rows."""
    step = max(1, min(CHUNK_ELEMENTS // max(1, elements), SUM_ROWS // positions))
    return [slice(i, min(i + step, batch)) for i in range(0, batch, step)]


def positions_norms(a: Tensor, g: Tensor) -> Bound:
    """A bound on the per-sample norm of the gradient of G maps applied at T positions,
    ``(Σ_k ‖Σ_t g_{t,k} a_{t,k}ᵀ‖_F²)^½``, for ``a`` [B, G, T, d] and ``g`` [B, G, T, p], that
    also covers what ``positions_sum`` adds for a sample beyond it.

    T = 1: rank one, ‖a‖·‖g‖ per map (``workers.dp.bounds.product``); the sum forms each entry of
    c·g aᵀ as two products, covered by ``bounds.CLIP_ROUNDINGS``.
    T > 1: ghost norm or instantiation (by ``use_ghost``) in float32 plus a guard κ·S_i²,
    S_i = Σ_t ‖a_t‖·‖g_t‖ ≥ ‖G_i‖, that covers both the norm's rounding and the clipped sum's
    (``bounds.ghost_guard``, ``bounds.instantiated_guard``): every clipping function (c_i·ν_i ≤
    R_m) keeps c_i·(‖G_i‖ + γ·S_i) ≤ R_m, so what is actually added for sample i stays within its
    bound however much its terms cancel (inputs M·v and M·v + δ with output gradients +w and −w
    give −w δᵀ, whose float32 ghost norm is rounding noise). For ordinary data κ ≈ 5·10⁻⁴ and
    S_i/‖G_i‖ is moderate. What remains is the adding of chunk partial sums, whose terms are
    already clipped contributions: the usual rounding of a sum of bounded terms.
    """
    batch, groups, positions, d = a.shape
    p = g.shape[-1]
    rows = _sum_rows(positions)
    if positions == 1:
        a_norms, g_norms = (bounds.row_norms(x[:, :, 0].flatten(0, 1)) for x in (a, g))
        return bounds.over_maps(bounds.product(a_norms, g_norms), groups)
    ghost = use_ghost(positions, d, p)
    transient = positions * positions if ghost else p * d
    squares = [
        _guarded_squares(a[part], g[part], ghost, rows)
        for part in _chunks(batch, groups * (positions * (d + p) + transient))
    ]
    return bounds.from_squares(_cat(squares, 0), bounds.guarded_scale(groups))


def _guarded_squares(a: Tensor, g: Tensor, ghost: bool, sum_rows: int) -> Tensor:
    """The guarded squares ν² [b] of ``positions_norms`` of one chunk of samples, its G maps'
    added."""
    d, p = a.shape[-1], g.shape[-1]
    spread, scale = bounds.spread(
        torch.linalg.vector_norm(a, dim=-1), torch.linalg.vector_norm(g, dim=-1), d, p
    )
    if ghost:
        return _ghost_squares(a @ a.mT, g, spread, scale, d, sum_rows)
    rows = (g.mT @ a).flatten(-2)  # [b, G, p·d]: the instantiated gradients
    unit = bounds.matmul_unit(a.device)
    squares = _instantiated(
        rows.flatten(0, 1), spread.flatten(), scale, a.shape[-2], sum_rows, unit
    )
    return _maps_added(squares.view(spread.shape))


def _instantiated(
    rows: Tensor, spread: Tensor, scale: float, positions: int, sum_rows: int, unit: float
) -> Tensor:
    """Guarded squares [n] of ``positions_norms`` from instantiated gradients ``rows`` [n, …]
    whose entries are sums of at most T terms of unit ``unit`` (``bounds.instantiated_guard``),
    and the spread Ŝ [n] with its scale; ``sum_rows``: the most rows a chunk of the clipped
    sum adds (``_sum_rows``)."""
    norm = bounds.raised(bounds.row_norms(rows))
    guard = bounds.instantiated_guard(positions, sum_rows, unit) * scale * scale
    return torch.addcmul(
        norm.value.square().mul_(bounds.up32((1 + bounds.ETA) * norm.scale**2)),
        spread,
        spread,
        value=bounds.up32(guard),
    )


def _ghost_squares(
    gram_a: Tensor, g: Tensor, spread: Tensor, scale: float, d: int, sum_rows: int
) -> Tensor:
    """The guarded ghost squares [b] of ``positions_norms`` (G maps added) from the Gram matrices
    of the inputs a_t·a_s [b, G, T, T] (overwritten; each entry a dot product of at most d terms,
    as ``ConvRule._pixel_norms`` forms them too), the output gradients [b, G, T, p], the
    spread Ŝ [b, G] with its scale (``bounds.spread``) and the most rows a chunk of the clipped
    sum adds (``_sum_rows``)."""
    positions, p = g.shape[-2], g.shape[-1]
    kappa = bounds.ghost_guard(d, p, positions, sum_rows, bounds.matmul_unit(g.device))
    sq = gram_a.mul_(g @ g.mT).sum((-2, -1)).clamp_min_(0.0)
    return _maps_added(torch.addcmul(sq, spread, spread, value=bounds.up32(kappa * scale * scale)))


def _maps_added(squares: Tensor) -> Tensor:
    """Squares [b, G] summed over the G maps (an operation only where G > 1)."""
    return squares.sum(-1) if squares.shape[-1] > 1 else squares.squeeze(-1)


def positions_sum(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """``Σ_i coef[i] Σ_t g_{i,t,k} a_{i,t,k}ᵀ`` [G, p, d] for ``a`` [B, G, T, d], ``g``
    [B, G, T, p], in ``g``'s dtype: for T > 1 by chunks of at most ``SUM_ROWS`` (sample, position)
    rows whose partial sums are added (see ``positions_norms``)."""
    batch, groups, positions, d = a.shape
    p = g.shape[-1]
    if positions == 1:
        return torch.einsum("bkp,bkd->kpd", _scaled(g[:, :, 0], coef), a[:, :, 0])
    parts = [
        _scaled(g[part], coef[part]).permute(1, 3, 0, 2).flatten(2)
        @ a[part].transpose(0, 1).flatten(1, 2)
        for part in _sum_chunks(batch, positions, positions * groups * (d + p))
    ]
    return functools.reduce(Tensor.add_, parts)


def _scaled(g: Tensor, coef: Tensor) -> Tensor:
    """``diag(C) · g``: sample i of ``g`` times ``coef[i]``, in ``g``'s dtype. No product
    overflows: c_i·|g_j| ≤ c_i·‖g_i‖ ≤ R_m/‖a_i‖-bound, and the bounds are raised to at least
    2⁻⁶³ (``bounds.raised``), so it stays below 2⁶³·R_m."""
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


def _row_size(x: Tensor) -> int:
    """The number of elements of ``x[0]``, from the shape (indexing is an operation of its own,
    several microseconds in a step)."""
    return math.prod(x.shape[1:])


@functools.cache
def _one(device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.ones(1, device=device, dtype=dtype)


def _ones(x: Tensor) -> Tensor:
    """A 1 of ``x``'s device and dtype, made once (expanded, it is a weight of ones: a view)."""
    return _one(x.device, x.dtype)


def _trainable(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad


class LayerRule:
    """How the fast path treats one module type.

    ``small`` gives the instantiated per-sample gradients [B, *shape] of the parameters whose
    per-sample gradients are cheap (biases, affine norm parameters); subclasses with a weight
    matrix add ``weight_norms`` / ``weight_sum`` / ``weight_per_sample`` for it.

    ``keeps_per_sample`` says when one call's per-sample gradients are worth holding instead
    of its book-kept input and output gradient (less memory, or for convolutions a little more
    memory and far less time); the clipper then forms them as soon as the output gradient
    exists in the backward pass and drops both (FastDP's mixed book-keeping).
    """

    has_weight_matrix = False

    def fallback_reason(self, module: nn.Module) -> str | None:
        """None when this rule handles ``module``, else why it must fall back."""
        return None

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        raise NotImplementedError

    def saved(self, activation: Tensor, output: Tensor) -> Any:
        """What the module's forward on ``activation`` computed that ``small`` reuses (no
        operation: references to tensors its output's autograd node holds); None if nothing."""
        return None

    def weight_norms(self, module: nn.Module, calls: Sequence[Call]) -> Bound:
        raise NotImplementedError

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        raise NotImplementedError

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        raise NotImplementedError

    def keeps_per_sample(
        self, module: nn.Module, activation: Tensor, output_shape: torch.Size
    ) -> bool:
        return not self.has_weight_matrix

    def per_sample(self, module: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-sample gradients [B, *shape] of one call, for each trainable parameter."""
        out = self.small(module, [call])
        if self.has_weight_matrix and _trainable(module, "weight"):
            out["weight"] = self.weight_per_sample(module, call)
        return out

    def add_weight_sum(
        self, module: nn.Module, calls: Sequence[Call], coef: Tensor, out: Tensor
    ) -> None:
        out.add_(self.weight_sum(module, calls, coef))

    def stack_key(self, module: nn.Module, calls: Sequence[Call]) -> Hashable | None:
        """Book-kept layers of one key are measured and summed together, as the maps of one
        layer (``stacked``); None: this one alone."""
        return None

    def stacked(
        self, modules: Sequence[nn.Module], calls: Sequence[Call]
    ) -> tuple[nn.Module, Call]:
        """One layer (parameters on the meta device: only their shapes are read) and its call
        whose weight gradient is that of ``modules``, each called once (``calls``), stacked on
        the first axis of the weight."""
        raise NotImplementedError


def _bias_rows(module: nn.Module, calls: Sequence[Call], channel_dim: int) -> dict[str, Tensor]:
    """Per-sample bias gradient [B, p]: output gradients summed over every non-channel axis."""
    if not _trainable(module, "bias"):
        return {}
    per_call = []
    for call in calls:
        g = call.grad.movedim(channel_dim, -1)
        per_call.append(g if g.dim() == 2 else g.reshape(g.shape[0], -1, g.shape[-1]).sum(1))
    return {"bias": _rows(per_call)}


class LinearRule(LayerRule):
    """``nn.Linear`` on inputs [B, d] or [B, ..., d]; all middle axes count as positions."""

    has_weight_matrix = True

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        return _bias_rows(module, calls, -1)

    @staticmethod
    def _positions(calls: Sequence[Call]) -> tuple[Tensor, Tensor]:
        """Inputs [B, 1, T, d] and output gradients [B, 1, T, p], calls concatenated along T."""

        def positions(x: Tensor) -> Tensor:
            return x.reshape(x.shape[0], 1, -1, x.shape[-1])

        return (
            _cat([positions(c.activation) for c in calls], 2),
            _cat([positions(c.grad) for c in calls], 2),
        )

    @staticmethod
    def _rank_one(calls: Sequence[Call]) -> bool:
        """One call on [B, d]: each example's weight gradient is g_i a_iᵀ, its bias's g_i."""
        return len(calls) == 1 and calls[0].grad.dim() == 2

    def weight_norms(self, module: nn.Module, calls: Sequence[Call]) -> Bound:
        return positions_norms(*self._positions(calls))

    def keeps_per_sample(
        self, module: nn.Module, activation: Tensor, output_shape: torch.Size
    ) -> bool:
        d, p = activation.shape[-1], output_shape[-1]
        positions = _row_size(activation) // d
        return positions > 1 and not use_ghost(positions, d, p)  # then p·d < T(d + p)

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        batch = call.grad.shape[0]
        g = call.grad.reshape(batch, -1, call.grad.shape[-1])
        return g.mT @ call.activation.reshape(batch, -1, call.activation.shape[-1])

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        return positions_sum(*self._positions(calls), coef)[0]

    def add_weight_sum(
        self, module: nn.Module, calls: Sequence[Call], coef: Tensor, out: Tensor
    ) -> None:
        """Rank one: ``out += (diag(C)·g)ᵀ · a`` in one matmul straight into the buffer, with no
        temporary of the weight's size."""
        if self._straight_into(calls, out):
            out.addmm_(_scaled(calls[0].grad, coef).T, calls[0].activation)
        else:
            super().add_weight_sum(module, calls, coef, out)

    def _straight_into(self, calls: Sequence[Call], out: Tensor) -> bool:
        """Whether the rank-one weight sum can be added into ``out`` by ``addmm_``."""
        return self._rank_one(calls) and out.dtype == calls[0].grad.dtype


class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` (any stride, dilation, groups, zero padding).

    A convolution is a linear map on the unfolded patches [B, C_in·k, T] (one per conv group),
    so norms are those of ``positions_norms`` on the patches, a bounded chunk of samples at a
    time (ghost norms with the patches' Gram matrices formed from the pixels' where that is
    cheaper, ``_pixel_norms``), and clipped sums those of ``positions_sum`` (``weight_sum``),
    the patches copied out of a channels-last view of the input. Per-sample gradients formed in the
    backward pass (``keeps_per_sample``) come from one grouped weight-gradient convolution, or
    from batched matmuls over the patches where those are faster (``weight_per_sample``).
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
        p, d = module.out_channels // module.groups, _row_size(module.weight)  # per conv group
        return use_ghost(positions, d, p)

    def keeps_per_sample(
        self, module: nn.Module, activation: Tensor, output_shape: torch.Size
    ) -> bool:
        """Keep per-sample gradients wherever the instantiated norm is the cheaper one (as for
        a linear layer over several positions). They are then smaller than the unfolded
        patches and output gradients of a sample (p·d < T(d + p)), and holding them (in
        float32, ``weight_per_sample``) beats book-keeping on time by far: the book-kept route
        unfolds the patches, k/stride² times the input, twice (norm, sum). The price is memory
        under all-layer clipping, which holds them until every norm is known
        (docs/performance.md, the step and styles tables)."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        return not self._ghost_cheaper(module, math.prod(output_shape[2:]))

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        """Per-sample weight gradients [B, *weight]: by one weight-gradient convolution with the
        samples as extra groups (``_grouped_per_sample``), or on CPU, for an ungrouped
        convolution, by batched matmuls over the patches (``_matmul_per_sample``) where those
        are faster for this geometry on the trial's first steps (``_Faster``). Neither wins
        everywhere: on CPU, oneDNN's grouped convolution is slower than the matmuls for few
        input channels and a large kernel (paper 001's first layer: 3 channels, 8×8) and faster
        for many channels (resnet18's convolutions). Both give the same gradients up
        to rounding, and a step's norms and clipped sums are both formed from the one result
        it gets."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        x4, geo = self._as_2d(module, call.activation)
        g4 = call.grad.unsqueeze(-2) if isinstance(module, nn.Conv1d) else call.grad
        args = (x4, g4, geo, module.groups, module.weight.shape)
        if module.groups != 1 or x4.device.type != "cpu":
            return _grouped_per_sample(*args)
        # not the batch size: Poisson batches vary it every step
        key = (x4.shape[1:], g4.shape[1:], tuple(geo.values()), x4.dtype)
        if key not in _FASTER:
            _FASTER[key] = _Faster([_grouped_per_sample, _matmul_per_sample])
        return _FASTER[key](*args)

    def _patch_chunks(self, module: nn.Conv1d | nn.Conv2d, calls: Sequence[Call]) -> list[slice]:
        """Chunks of samples whose unfolded patches and output gradients fit the chunk size."""
        positions = sum(_row_size(c.grad) // module.out_channels for c in calls)
        p, d = module.out_channels // module.groups, _row_size(module.weight)  # per group
        return _chunks(calls[0].grad.shape[0], module.groups * positions * (d + p))

    def _positions(
        self, module: nn.Conv1d | nn.Conv2d, calls: Sequence[Call], part: slice
    ) -> tuple[Tensor, Tensor]:
        """Patches [b, G, T, d] and output gradients [b, G, T, p] of the samples in ``part``,
        calls concatenated along T, one map per conv group. A patch's d values are in
        channels-last order, (k_h, k_w, C_in/G) (``_channels_last_patches``). The patches are
        copied maps first, so that the sum's [G, b·T, d] (``positions_sum``) is a view of them."""
        patches, grads = [], []
        for call in calls:
            x4, geo = self._as_2d(module, call.activation[part])
            g = call.grad[part]
            out = g.shape[2:] if isinstance(module, nn.Conv2d) else (1, g.shape[-1])
            b, groups, positions = len(g), module.groups, math.prod(out)
            view = _channels_last_patches(x4, out, geo, groups)  # [b, *out, k…, G, C_in/G]
            maps_first = view.permute(5, 0, 1, 2, 3, 4, 6).reshape(groups, b, positions, -1)
            patches.append(maps_first.transpose(0, 1))
            grads.append(g.reshape(b, groups, -1, positions).transpose(-1, -2))
        return _cat(patches, 2), _cat(grads, 2)

    def weight_norms(self, module: nn.Module, calls: Sequence[Call]) -> Bound:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        if self._from_pixels(module, calls):
            return self._pixel_norms(module, calls[0])
        return bounds.cat(
            [
                positions_norms(*self._positions(module, calls, part))
                for part in self._patch_chunks(module, calls)
            ]
        )

    def _from_pixels(self, module: nn.Conv1d | nn.Conv2d, calls: Sequence[Call]) -> bool:
        """Whether the ghost norm of one call over several positions is the cheaper norm, and
        cheaper still with its patches' Gram matrices formed from its pixels'
        (``_pixel_norms``): P²·C_in + G·K·T² multiply-adds a sample against the patches'
        G·T²·d = K·T²·C_in (P padded pixels, K kernel offsets). For stride 1 that holds from
        about 3×3 outputs up (P ≈ T); for stride 2 it does not (P ≈ 4T)."""
        if len(calls) != 1:
            return False
        positions = _row_size(calls[0].grad) // module.out_channels
        if positions == 1 or not self._ghost_cheaper(module, positions):
            return False
        x4, geo = self._as_2d(module, calls[0].activation[:1])
        pixels = math.prod(n + 2 * pad for n, pad in zip(x4.shape[2:], geo["padding"], strict=True))
        grams = module.groups * positions * positions
        offsets, d = math.prod(geo["kernel_size"]), _row_size(module.weight)
        return pixels * pixels * module.in_channels + offsets * grams < grams * d

    def _pixel_norms(self, module: nn.Conv1d | nn.Conv2d, call: Call) -> Bound:
        """``positions_norms``' ghost norm, its patches' Gram matrices formed from the pixels'
        (no unfolded copy of the patches, and P²·C_in work a sample for K·T²·C_in): patch t holds
        the pixels π(t, k) that kernel offset k reads, zero padding included, so

            a_t·a_s = Σ_k X_{π(t,k)}·X_{π(s,k)},    X_π the pixel's channels (one conv group's).

        Rounding: each X_π·X_ρ is a dot product of C_in/G terms, and K of them are added, so an
        entry is within γ_{C_in/G + K − 1}·Σ|products| ≤ γ_d·‖a_t‖·‖a_s‖ of the exact one
        (C_in/G + K − 1 ≤ d = K·C_in/G; Cauchy–Schwarz): the unfolded patches' bound, and
        ‖a_t‖² (the diagonal, a sum of squares) within γ_d of its value, as a norm's
        (``bounds.spread`` with the matrix products' unit). The guard of ``positions_norms``
        holds unchanged."""
        x4, geo = self._as_2d(module, call.activation)
        (ph, pw), groups = geo["padding"], module.groups
        g4 = call.grad.unsqueeze(-2) if isinstance(module, nn.Conv1d) else call.grad
        padded = (x4.shape[-2] + 2 * ph, x4.shape[-1] + 2 * pw)
        pairs, offsets, positions = _pixel_pairs(
            padded, tuple(g4.shape[-2:]), tuple(geo.items()), x4.device
        )
        pixels = padded[0] * padded[1]
        per_sample = groups * (pixels * pixels + (offsets + 2) * positions * positions)
        d, p = _row_size(module.weight), module.out_channels // groups
        unit = bounds.matmul_unit(x4.device)
        out = []
        for part in _chunks(len(x4), per_sample + _row_size(x4) + _row_size(g4)):
            x = F.pad(x4[part], (pw, pw, ph, ph)).reshape(len(x4[part]), groups, -1, pixels)
            by_pixel = (x.mT @ x).flatten(-2)  # [b, G, P·P]
            gram = by_pixel[..., pairs].view(len(x), groups, offsets, positions, positions).sum(2)
            g = g4[part].reshape(len(x), groups, -1, positions).mT  # [b, G, T, p]
            spread, scale = bounds.spread(
                gram.diagonal(dim1=-2, dim2=-1).sqrt(),
                torch.linalg.vector_norm(g, dim=-1),
                d,
                p,
                unit_a=unit,
            )
            out.append(_ghost_squares(gram, g, spread, scale, d, _sum_rows(positions)))
        return bounds.from_squares(_cat(out, 0), bounds.guarded_scale(groups))

    def stack_key(self, module: nn.Module, calls: Sequence[Call]) -> Hashable | None:
        """Ungrouped convolutions of one geometry called once on inputs of one shape: stacked
        (``stacked``), they are the G maps of one grouped convolution, whose norm over the maps
        and per-map sums ``positions_norms`` and ``positions_sum`` already take in one set of
        operations (resnet18's three same-shaped convolutions of a stage)."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        if len(calls) != 1 or module.groups != 1:
            return None
        a, g = calls[0].activation, calls[0].grad
        geometry = (module.kernel_size, module.stride, module.padding, module.dilation)
        return type(module), geometry, a.shape[1:], g.shape[1:], a.dtype, g.dtype, a.device

    def stacked(
        self, modules: Sequence[nn.Module], calls: Sequence[Call]
    ) -> tuple[nn.Module, Call]:
        """The convolution of G = len(``modules``) conv groups whose group k is ``modules[k]``:
        inputs and output gradients concatenated on the channel axis (two copies)."""
        first = modules[0]
        assert isinstance(first, nn.Conv1d | nn.Conv2d)
        grouped = _grouped(
            isinstance(first, nn.Conv1d),
            (first.in_channels, first.out_channels, len(modules)),
            (first.kernel_size, first.stride, first.padding, first.dilation),
        )
        cat = functools.partial(torch.cat, dim=1)
        return grouped, Call(cat([c.activation for c in calls]), cat([c.grad for c in calls]))

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        """``Σ_i coef[i] Σ_t g_t a_tᵀ`` by ``positions_sum`` over the patches, a chunk of
        samples at a time (``_sum_chunks``: at most max(T, ``SUM_ROWS``) rows, and the padded
        inputs, scaled output gradients and patches bounded), whose partial sums are added; the
        patches' channels-last order is permuted back on the weight-sized sum.

        Each chunk is a few whole-chunk operations (one copy of the patches, one matrix
        product), never a loop over its samples: the sum's rounding is that of one matrix
        product of at most ``SUM_ROWS`` rows, which the norm's guard covers."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        batch = calls[0].grad.shape[0]
        positions = sum(_row_size(c.grad) // module.out_channels for c in calls)
        # inputs (and their padded copy), output gradients (scaled, reordered) and patches
        elements = sum(2 * _row_size(c.activation) + 3 * _row_size(c.grad) for c in calls)
        elements += positions * module.groups * _row_size(module.weight)
        total = functools.reduce(
            Tensor.add_,  # each chunk's sum is a fresh tensor: the first one takes the rest
            (
                positions_sum(*self._positions(module, calls, part), coef[part])
                for part in _sum_chunks(batch, positions, elements)
            ),
        )
        kernel = module.weight.shape[2:]
        channels_last = total.view(module.out_channels, *kernel, -1)  # [O, k…, C_in/G]
        return channels_last.movedim(-1, 1).reshape(module.weight.shape)


@functools.cache
def _grouped(one_d: bool, channels: tuple[int, int, int], geometry: tuple) -> nn.Conv1d | nn.Conv2d:
    """A Conv1d (``one_d``) or Conv2d of G conv groups of ``channels`` (in, out, G) a group, on
    the meta device (``ConvRule.stacked``: the rule reads only its geometry and its weight's
    shape)."""
    inputs, outputs, maps = channels
    kernel, stride, padding, dilation = geometry
    return (nn.Conv1d if one_d else nn.Conv2d)(
        maps * inputs,
        maps * outputs,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=maps,
        bias=False,
        device="meta",
    )


def _channels_last_patches(
    x4: Tensor, out: tuple[int, ...], geo: dict[str, tuple], groups: int
) -> Tensor:
    """The patches of a 2-D convolution's input ``x4`` [b, C, H, W] at its ``out`` output
    positions, as a strided view [b, *out, k_h, k_w, G, C/G] of the input padded in
    channels-last order (one copy): there a kernel row's k_w·C values are contiguous, so
    copying patches out of the view moves runs of k_w·C values where the channels-first order
    (``F.unfold``'s, one im2col per sample) moves runs of k_w."""
    (ph, pw), (sh, sw), (dh, dw), (kh, kw) = (
        geo["padding"],
        geo["stride"],
        geo["dilation"],
        geo["kernel_size"],
    )
    x = F.pad(x4.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph))  # [b, H, W, C]
    b, c, st = x.shape[0], x.shape[3], x.stride()
    return x.as_strided(
        (b, *out, kh, kw, groups, c // groups),
        (st[0], sh * st[1], sw * st[2], dh * st[1], dw * st[2], c // groups * st[3], st[3]),
    )


@functools.cache
def _pixel_pairs(
    padded: tuple[int, int], out: tuple[int, ...], geo: tuple[tuple, ...], device: torch.device
) -> tuple[Tensor, int, int]:
    """(pairs [K·T·T], K, T) for ``ConvRule._pixel_norms``: the flat index, in the pixels' Gram
    matrix [P·P] of an input of ``padded`` size, of the pixel pair that kernel offset k reads at
    output positions t and s (``out``: the output's height and width; ``geo``: the geometry's
    items). Built once a geometry: a handful of index operations that a step need not repeat."""
    shape = dict(geo)
    (kh, kw), (dh, dw), (sh, sw) = shape["kernel_size"], shape["dilation"], shape["stride"]

    def axis(size: int, dilation: int, outputs: int, stride: int) -> Tensor:  # [k, n]
        offsets = torch.arange(size, device=device) * dilation
        return offsets[:, None] + torch.arange(outputs, device=device)[None, :] * stride

    rows, cols = axis(kh, dh, out[0], sh), axis(kw, dw, out[1], sw)
    reads = (rows[:, None, :, None] * padded[1] + cols[None, :, None, :]).reshape(kh * kw, -1)
    pixels = padded[0] * padded[1]
    pairs = (reads.unsqueeze(-1) * pixels + reads.unsqueeze(-2)).flatten()
    return pairs, reads.shape[0], reads.shape[1]


def _grouped_per_sample(
    x4: Tensor, g4: Tensor, geo: dict[str, tuple], groups: int, weight: torch.Size
) -> Tensor:
    """Per-sample weight gradients [B, *weight] of a 2-D convolution from one weight-gradient
    convolution with the samples as extra groups (``torch.nn.grad.conv2d_weight``'s call, the
    weight it asks for only for its shape: a view of a cached 1, no allocation a step)."""
    b = x4.shape[0]
    return torch.ops.aten.convolution_backward(
        g4.reshape(1, -1, *g4.shape[2:]),
        x4.reshape(1, -1, *x4.shape[2:]),
        _ones(x4).expand(b * weight[0], weight[1], *geo["kernel_size"]),
        None,
        geo["stride"],
        geo["padding"],
        geo["dilation"],
        False,
        [0],
        b * groups,
        (False, True, False),
    )[1].view(b, *weight)


def _matmul_per_sample(
    x4: Tensor, g4: Tensor, geo: dict[str, tuple], groups: int, weight: torch.Size
) -> Tensor:
    """Per-sample weight gradients [B, *weight] of an ungrouped 2-D convolution as
    ``g_i · P_iᵀ``: output gradients [O, T] times patches [T, k·C] per sample, the patches
    copied a few samples (``PATCH_CHUNK``) at a time out of their channels-last view
    (``_channels_last_patches``: paper 001's first layer, 3 channels and an 8×8 kernel, copies
    runs of 24 floats where the channels-first order would copy runs of 8). The result keeps
    the patches' order in memory (a permuted view, [B, O, C, k] laid out as [B, O, k, C]):
    norms and clipped sums take it in that order (``workers.dp.clipping.in_memory_order``)
    and no second copy of the gradients is made."""
    assert groups == 1
    (oh, ow), (kh, kw), c = g4.shape[-2:], geo["kernel_size"], x4.shape[1]
    view = _channels_last_patches(x4, (oh, ow), geo, 1)
    b = len(view)
    positions, width = oh * ow, c * kh * kw
    out = x4.new_empty(b, weight[0], width)
    grads = g4.reshape(b, weight[0], positions)
    step = max(1, PATCH_CHUNK // (positions * width))
    for i in range(0, b, step):
        patches = view[i : i + step].reshape(-1, positions, width)
        torch.bmm(grads[i : i + step], patches, out=out[i : i + step])
    return out.view(b, weight[0], kh, kw, c).permute(0, 1, 4, 2, 3).view(b, *weight)


class _Faster:
    """Runs the faster of ``candidates`` for one convolution geometry, found on the trial's
    own steps: each candidate serves in turn until each has run ``TIMED_RUNS`` times, then the
    one with the least time per sample in any of its runs (the least disturbed; its first run
    also sets up its kernels) serves from then on."""

    def __init__(self, candidates: list[PerSampleConv]) -> None:
        self.seconds: dict[PerSampleConv, list[float]] = {c: [] for c in candidates}
        self.chosen: PerSampleConv | None = None

    def __call__(self, x4: Tensor, *rest: Any) -> Tensor:
        if self.chosen is not None:
            return self.chosen(x4, *rest)
        candidate = min(self.seconds, key=lambda c: len(self.seconds[c]))
        started = time.perf_counter()
        out = candidate(x4, *rest)
        self.seconds[candidate].append((time.perf_counter() - started) / max(1, len(x4)))
        if all(len(runs) >= TIMED_RUNS for runs in self.seconds.values()):
            self.chosen = min(self.seconds, key=lambda c: min(self.seconds[c]))
        return out


#: per convolution geometry on CPU, the way its per-sample weight gradients are formed
#: (``ConvRule.weight_per_sample``)
_FASTER: dict[tuple[object, ...], _Faster] = {}


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
    def _ids_and_grads(module: nn.Module, calls: Sequence[Call]) -> tuple[Tensor, Tensor]:
        """Ids [B, T] and output gradients [B, T, p] (zero at ``padding_idx``), calls
        concatenated along T."""
        batch = calls[0].grad.shape[0]
        ids = torch.cat([c.activation.reshape(batch, -1) for c in calls], 1)
        g = torch.cat([c.grad.reshape(batch, -1, c.grad.shape[-1]) for c in calls], 1)
        if module.padding_idx is not None:
            g = torch.where((ids != module.padding_idx).unsqueeze(-1), g, 0)
        return ids, g

    def keeps_per_sample(
        self, module: nn.Module, activation: Tensor, output_shape: torch.Size
    ) -> bool:
        """Keep the per-sample gradients of an embedding with at most as many ids as positions
        (a position embedding): [V, p] a sample, no more than its output gradients [T, p]."""
        assert isinstance(module, nn.Embedding)
        return module.num_embeddings <= _row_size(activation)

    def weight_per_sample(self, module: nn.Module, call: Call) -> Tensor:
        """Per-sample weight gradients [B, V, p]: each position's output gradient added into
        its example's row of its id, by one ``index_add_`` (row i·V + id)."""
        assert isinstance(module, nn.Embedding)
        ids, g = self._ids_and_grads(module, [call])
        batch, vocab = len(g), module.num_embeddings
        first = torch.arange(0, batch * vocab, vocab, device=g.device).unsqueeze(1)
        rows = g.new_zeros(batch * vocab, g.shape[-1])
        rows.index_add_(0, (ids + first).flatten(), g.flatten(0, 1))
        return rows.view(batch, vocab, -1)

    def weight_norms(self, module: nn.Module, calls: Sequence[Call]) -> Bound:
        """``positions_norms``' bound with one-hot inputs (‖a_t‖ = 1, so S_i = Σ_t ‖g_t‖), with
        no data-dependent shape (no ``unique``: a host sync on a GPU). With at most as many ids
        as positions (a position embedding) the per-sample gradient is instantiated densely,
        [V, p] a sample, by one ``index_add_``: a row's sum of at most T terms is within γ_T of
        its terms' magnitudes, as an instantiated gradient's entries (``_instantiated``).
        Otherwise the ghost norm with the exact Gram matrix [x_t = x_s] of the one-hot inputs
        (d = 1 in ``bounds.ghost_guard``). Rows repeated at several positions may cancel like
        any ghost norm; the guard covers that."""
        ids, g = self._ids_and_grads(module, calls)
        batch, positions, p = g.shape
        vocab, rows_summed = module.num_embeddings, _sum_rows(positions)
        dense = vocab <= positions
        out = []
        for part in _chunks(batch, positions * (p + (vocab * p if dense else positions))):
            gp, idp = g[part], ids[part]
            spread, scale = bounds.spread(None, torch.linalg.vector_norm(gp, dim=-1), 1, p)
            if dense:
                sample = torch.arange(len(gp), device=gp.device).unsqueeze(1) * vocab
                rows = gp.new_zeros(len(gp) * vocab, p).index_add_(
                    0, (idp + sample).flatten(), gp.flatten(0, 1)
                )
                out.append(
                    _instantiated(
                        rows.view(len(gp), -1), spread, scale, positions, rows_summed, bounds.U
                    )
                )
            else:
                same = (idp.unsqueeze(-1) == idp.unsqueeze(-2)).to(gp.dtype)
                out.append(
                    _ghost_squares(
                        same.unsqueeze(1),
                        gp.unsqueeze(1),
                        spread.unsqueeze(1),
                        scale,
                        1,
                        rows_summed,
                    )
                )
        return bounds.from_squares(_cat(out, 0), bounds.guarded_scale(1))

    def weight_sum(self, module: nn.Module, calls: Sequence[Call], coef: Tensor) -> Tensor:
        """Scaled rows added into the weight-shaped sum per chunk of samples (``_sum_chunks``),
        the chunks' sums added: partial sums of clipped contributions."""
        assert isinstance(module, nn.Embedding)
        ids, g = self._ids_and_grads(module, calls)
        batch, positions, p = g.shape
        parts = [
            torch.zeros_like(module.weight).index_add_(
                0, ids[part].flatten(), _scaled(g[part], coef[part]).flatten(0, 1)
            )
            for part in _sum_chunks(batch, positions, positions * p)
        ]
        return functools.reduce(Tensor.add_, parts)


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
    """``nn.GroupNorm``: per-channel affine on x̂; per-sample ∂L_i/∂w_c = Σ_t g_{c,t}·x̂_{c,t} and
    ∂L_i/∂b_c = Σ_t g_{c,t} over the spatial positions t.

    Both come from one call of torch's group-norm backward (``native_group_norm_backward``)
    on the batch seen as one sample of B·C channels in B·G groups: each group's statistics are
    those of the same channels of the same example, and the "per-channel" weight and bias
    gradients it returns are the per-sample ones [B·C]. Its mean and 1/σ [B, G] are those the
    forward computed (``saved``), read from the output's autograd node, else recomputed."""

    def saved(self, activation: Tensor, output: Tensor) -> Any:
        """The forward's mean and 1/σ, where its node normalised ``activation``'s values in their
        own dtype (a contiguous copy of them, say, but not a converted one)."""
        node = output.grad_fn
        if type(node).__name__ != "NativeGroupNormBackward0":
            return None
        normalised = node._saved_input  # type: ignore[union-attr]
        if (normalised.shape, normalised.dtype) != (activation.shape, activation.dtype):
            return None
        return node._saved_result1, node._saved_result2  # type: ignore[union-attr]

    def small(self, module: nn.Module, calls: Sequence[Call]) -> dict[str, Tensor]:
        assert isinstance(module, nn.GroupNorm)
        weight, bias = [], []
        for call in calls:
            x, c, groups = call.activation.contiguous(), module.num_channels, module.num_groups
            batch, positions = x.shape[0], _row_size(x) // c
            mean, rstd = (
                call.saved
                or torch.ops.aten.native_group_norm(
                    x, None, None, batch, c, positions, groups, module.eps
                )[1:]
            )
            _, w, b = torch.ops.aten.native_group_norm_backward(
                call.grad.reshape(1, batch * c, positions),
                x.reshape(1, batch * c, positions),
                mean.reshape(1, -1),
                rstd.reshape(1, -1),
                _ones(x).expand(batch * c),  # not read (no input gradient asked), but required
                1,
                batch * c,
                positions,
                batch * groups,
                [False, True, True],
            )
            weight.append(w.view(batch, c))
            bias.append(b.view(batch, c))
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
