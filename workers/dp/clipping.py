"""Clipping groups and clipping functions.

Group-wise clipping (paper 002, eq. 4): the trainable parameters are split into M groups; the
per-sample gradient restricted to group m is clipped at R_m = R/√M, so the concatenated clipped
gradient has norm at most ‖[R_1, …, R_M]‖₂ = R and one Gaussian noise of std σR covers all groups.
(Paper 002's Algorithm 1 drops the 1/√M, which would make the sensitivity √M·R; we follow eq. 4.)

Hostile records (docs/design.md, invariant 9) are handled here for both clippers: norms are
float32 upper bounds on the exact ones (``workers.dp.bounds``: the error analysis, in one place);
an example gets clip factor 0 in every group where its bound is not finite (``clip_factors``: a
NaN or infinite value, or a norm beyond float32's squares), and its rows are zeroed before any
product that adds to such a group (``zero_rows``), since 0·NaN = NaN; no step tests for them on
the host. Zeroing a group never raises the sensitivity: every example still adds at most R_m to
each group, so at most R in all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from core.config import ClippingFunction
from workers.dp.bounds import Bound, row_norms

GroupSpec = str | Sequence[Sequence[str]] | None
#: The clip factor as a function of group norms, elementwise: a block [B, k] of any k groups'
#: norms gives their factors [B, k] (every group has the same R_m = R/√M), so a clipper can
#: clip each group as soon as its own norms are known.
CoefFn = Callable[[Tensor], Tensor]


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def resolve_groups(model: nn.Module, spec: GroupSpec) -> list[list[str]]:
    """Turn a clipping style into groups of full parameter names (each trainable parameter in
    exactly one group). ``spec`` is None/"all_layer", "layer_wise" (one group per module that owns
    parameters: weight and bias together), "param_wise" (one group per tensor) or a list of
    lists of name prefixes (a prefix matches the name itself or anything below it)."""
    names = trainable_names(model)
    if not names:
        raise ValueError("model: has no trainable parameters")
    if spec is None or spec == "all_layer":
        return [names]
    if spec == "param_wise":
        return [[name] for name in names]
    if spec == "layer_wise":
        return _layer_groups(model, set(names))
    if isinstance(spec, str):
        raise ValueError(f"method.style: unknown clipping style {spec!r}")
    return _prefix_groups(names, spec)


def _layer_groups(model: nn.Module, trainable: set[str]) -> list[list[str]]:
    groups = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        own = [
            prefix + n for n, _ in module.named_parameters(recurse=False) if prefix + n in trainable
        ]
        if own:
            groups.append(own)
    return groups


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _prefix_groups(names: list[str], spec: Sequence[Sequence[str]]) -> list[list[str]]:
    groups: list[list[str]] = [[] for _ in spec]
    for name in names:
        owners = [m for m, prefixes in enumerate(spec) if any(_matches(name, p) for p in prefixes)]
        if len(owners) != 1:
            where = "no group" if not owners else f"groups {owners}"
            raise ValueError(
                f"method.groups: parameter {name!r} matches {where}; "
                "each trainable parameter must be in exactly one group"
            )
        groups[owners[0]].append(name)
    for m, prefixes in enumerate(spec):
        if not groups[m]:
            raise ValueError(f"method.groups[{m}]: prefixes {list(prefixes)} match no parameter")
    return groups


def group_thresholds(threshold: float, num_groups: int) -> float:
    """R_m = R/√M (paper 002, eq. 4), so the total sensitivity stays R."""
    return threshold / math.sqrt(num_groups)


def coefficient_fn(
    function: ClippingFunction,
    threshold: float,
    num_groups: int,
    gamma: float = 0.01,
    scale: float = 1.0,
) -> CoefFn:
    """The per-sample, per-group clip factor C(g; R_m) as a function of norms [B, k], elementwise,
    times ``scale`` (the engine's 1/R: its contributions have norm ≤ 1, in units of the clip
    bound, docs/design.md invariant 12), in the norms' dtype (float32): the norms are raised by
    enough to cover these few roundings (``workers.dp.bounds.CLIP_ROUNDINGS``).

    ``abadi``: min(1, R_m/‖g‖) (Abadi et al. 2016). ``auto_s``: R_m/(‖g‖ + γ) and ``auto_v``:
    R_m/‖g‖ (paper 003, automatic clipping); each keeps ‖C·g‖ ≤ R_m, so the sensitivity bound is
    the same for all three. A zero gradient gets factor 0 under AUTO-V (any finite value would do).
    """
    r = group_thresholds(threshold, num_groups)
    return factor_fn(function, r, r * scale, gamma)


def factor_fn(
    function: ClippingFunction,
    r: float | Tensor,
    product: float | Tensor,
    gamma: float = 0.01,
) -> CoefFn:
    """:func:`coefficient_fn` from its constants R_m and R_m·scale (``product``), each rounded to
    float32 once, as a number is when an operation meets a float32 tensor. They may be float32
    0-dim tensors on the norms' device, read at each call: the engine writes a step's there,
    and one function serves every step, so that a call replayed from a CUDA graph
    (:mod:`workers.dp.graphed`) reads the step's threshold.

    Each factor is one division of R_m·scale (AUTO-S: after one sum); a clamp or a comparison
    rounds nothing, so the factor carries two roundings, AUTO-S's three (``CLIP_ROUNDINGS``)."""
    p = _operand(product)
    if function == "abadi":  # min(1, R_m/‖g‖)·scale = (R_m·scale)/max(‖g‖, R_m): one division
        return lambda norms: p / norms.clamp(min=r)
    if function == "auto_s":
        return lambda norms: p / (norms + gamma)
    if function == "auto_v":
        return lambda norms: torch.where(norms > 0, p / norms, 0.0)
    raise ValueError(f"method.clipping: unknown clipping function {function!r}")


def _operand(x: float | Tensor) -> Tensor:
    """``x`` as a tensor that can be divided by a tensor in one operation: a number as a 0-dim
    float64 tensor on the CPU, which takes the other's dtype there (rounded once to float32, as a
    number would be; on a GPU a kernel argument, no float64 arithmetic) and keeps its value for
    float64 norms (the audit's canaries). ``number / tensor`` would take a reciprocal and a
    product, two operations and two roundings."""
    return x if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float64)


def clip_factors(coef_fn: CoefFn, norms: Tensor) -> Tensor:
    """``coef_fn(norms)`` for norms [B, k], with factor 0 wherever the norm or the factor is not
    finite: an example contributes nothing to a group where its norm is not finite."""
    coef = coef_fn(norms)
    if coef.shape != norms.shape:
        raise ValueError(
            f"coef_fn: must return shape {tuple(norms.shape)}, got {tuple(coef.shape)}"
        )
    # norms are ≥ 0 or NaN: ``norms < ∞`` is their finiteness in one operation, not isfinite's
    # five (each small operation costs a CPU step several microseconds)
    return coef.nan_to_num(0.0, 0.0, 0.0).mul_(norms < math.inf)


def clipped_sum(coef: Tensor, per_sample: Tensor) -> Tensor:
    """Σ_i coef[i] · per_sample[i] [B, …] → […], in the per-sample tensor's dtype (a permuted
    view where ``per_sample`` is laid out in another order than its axes'). ``coef`` as
    ``clip_factors`` gives them (finite), or already in that dtype by ``factors_as``."""
    rows, order = in_memory_order(per_sample)
    same = coef.dtype == per_sample.dtype
    total = torch.tensordot(coef if same else factors_as(coef, per_sample.dtype), rows, dims=1)
    if rows is per_sample:
        return total
    return total.permute(sorted(range(total.dim()), key=lambda k: order[k + 1]))


def add_clipped_sum(out: Tensor, coef: Tensor, per_sample: Tensor) -> None:
    """``out += clipped_sum(coef, per_sample)``: one matrix-vector product straight into ``out``
    where both are laid out in order and of one dtype (one operation, one kernel launch, no
    temporary of the parameter's size), else through ``clipped_sum``."""
    same = coef.dtype == per_sample.dtype == out.dtype
    if same and out.is_contiguous() and per_sample.is_contiguous():
        out.view(-1).addmv_(per_sample.view(len(per_sample), -1).T, coef)
    else:
        out.add_(clipped_sum(coef, per_sample))


class FlatRows:
    """The instantiated per-sample gradients [B, …] of one clipping group's parameters as one
    buffer [B, D] (one copy, ``torch.cat``), so that the group takes a fixed handful of
    operations (kernel launches on a GPU) however many tensors it has: one norm bound (``bounds``:
    ``workers.dp.bounds.row_norms`` over D values, the analysis of one row with n = D), one
    operation that zeroes the dropped examples' rows, one matrix–vector product for all the
    clipped sums and one ``torch._foreach_add_`` that adds them into the parameters' buffers
    (``add_to``). A single tensor is not copied: it is zeroed out of place (the caller's rows
    are left alone), its sum added by one ``addmv_`` where that can write straight into its
    buffer."""

    def __init__(self, parts: Sequence[Tensor]) -> None:
        rows = [in_memory_order(x) for x in parts]
        #: each tensor's shape in memory order and the permutation back to its own axes
        self.layout = [(x.shape[1:], order) for x, order in rows]
        flat = [x.flatten(1) for x, _ in rows]
        self.owned = len(flat) > 1  # a copy of ours: zeroed in place
        self.rows = torch.cat(flat, 1) if self.owned else flat[0]

    def bounds(self) -> Bound:
        return row_norms(self.rows)

    def add_to(self, outs: Sequence[Tensor], coef: Tensor, drop: Tensor) -> None:
        """Add Σ_i coef[i]·x_i of every tensor into ``outs`` (in the order of ``parts``), the
        rows where ``drop`` [B] is true zeroed first (``zero_rows``: 0·NaN = NaN); ``coef`` is
        in the buffer's dtype (``factors_as``)."""
        mask = drop.view(-1, 1)
        rows = self.rows.masked_fill_(mask, 0) if self.owned else self.rows.masked_fill(mask, 0)
        if len(outs) == 1 and _straight(outs[0], rows, self.layout[0][1]):
            outs[0].view(-1).addmv_(rows.T, coef)
            return
        total = torch.mv(rows.T, coef)
        sizes = [math.prod(shape) for shape, _ in self.layout]
        pieces = [
            piece.view(shape).permute(sorted(range(len(order) - 1), key=lambda k: order[k + 1]))
            for piece, (shape, order) in zip(total.split(sizes), self.layout, strict=True)
        ]
        torch._foreach_add_(list(outs), pieces)


def _straight(out: Tensor, rows: Tensor, order: list[int]) -> bool:
    """Whether one tensor's clipped sum can be added by ``addmv_`` straight into ``out``."""
    return out.dtype == rows.dtype and out.is_contiguous() and order == sorted(order)


def in_memory_order(x: Tensor) -> tuple[Tensor, list[int]]:
    """``x`` [B, …] with the axes after the first permuted into the order they lie in memory
    (a view), and that permutation: per-sample tensors formed in another layout than their
    axes' (``ConvRule``'s channels-last per-sample gradients) then flatten without a copy."""
    if x.is_contiguous():
        return x, list(range(x.dim()))
    order = [0, *sorted(range(1, x.dim()), key=lambda k: -x.stride(k))]
    return x.permute(order), order


def zero_rows(x: Tensor, drop: Tensor) -> Tensor:
    """``x`` with the rows (first axis) where ``drop`` is true set to zero, out of place (one
    operation), before any product with clip factors (0·NaN = NaN): the examples whose norm
    bound is not finite, whose factor is 0 (``clip_factors``), then contribute exactly zero, and
    so does anything formed from their zeroed rows, with no test on the host."""
    if not x.is_floating_point():
        return x
    return x.masked_fill(drop.view(-1, *([1] * (x.dim() - 1))), 0)


def factors_as(coef: Tensor, dtype: torch.dtype) -> Tensor:
    """Clip factors in ``dtype``, clamped to its finite range where that is narrower than theirs.

    AUTO-V's R/‖g‖ may exceed a narrow dtype's range (float16's, for a small ‖g‖); an infinite
    factor would turn the zeros of g into NaN. Clamping lowers the factor, so ‖c·g‖ only shrinks,
    and c·|g_j| ≤ c·‖g‖ ≤ R keeps every product finite.
    """
    big = torch.finfo(dtype).max
    if big >= torch.finfo(coef.dtype).max:
        return coef.to(dtype)
    return coef.clamp(-big, big).to(dtype)
