"""Clipping groups and clipping functions.

Group-wise clipping (paper 002, eq. 4): the trainable parameters are split into M groups; the
per-sample gradient restricted to group m is clipped at R_m = R/√M, so the concatenated clipped
gradient has norm at most ‖[R_1, …, R_M]‖₂ = R and one Gaussian noise of std σR covers all groups.
(Paper 002's Algorithm 1 drops the 1/√M, which would make the sensitivity √M·R; we follow eq. 4.)

Hostile records (docs/design.md, invariant 9) are handled here for both clippers: squared norms
are upper bounds added up in float64 (``sq_norms``: float32 rows by blocks with a rounding guard,
a row whose blocks overflow wholly in float64), so a finite example gets a finite norm even
when its squared norm overflows float32; an example gets clip factor 0 in every group where its
norm is not finite (``clip_factors``), and its rows are zeroed before any product that adds to
such a group (``zero_rows``), since 0·NaN = NaN; factors are cast to the gradients' dtype
without overflowing (``factors_as``). Zeroing a group never raises the sensitivity: every
example still adds at most R_m to each group, so at most R in all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from core.config import ClippingFunction

GroupSpec = str | Sequence[Sequence[str]] | None
#: The clip factor as a function of group norms, elementwise: a block [B, k] of any k groups'
#: norms gives their factors [B, k] (every group has the same R_m = R/√M), so a clipper can
#: clip each group as soon as its own norms are known.
CoefFn = Callable[[Tensor], Tensor]

# Most elements ``sq_norms`` reduces in float64 at once (bounds its transient memory).
NORM_CHUNK = 1 << 18
# Elements of a float32 row that ``sq_norms`` sums in float32 before the partial sums are added
# in float64: its rounding guard grows with it (``_float32_guard``). Only float32 inputs of
# more than ``BLOCKS_ABOVE`` elements are summed so; smaller ones take one float64 reduction,
# which converts its input whole: 8 bytes an element for the moment. At 2¹⁸ that transient
# (1.5 MB for mlp's input at B = 64) set the mlp step's peak memory; at 2¹⁶ the step's time
# is the same (docs/speed-history.md).
NORM_BLOCK = 64
BLOCKS_ABOVE = 1 << 16
# Unit roundoffs of float32 and float64, and float32's smallest normal number.
U32, U64, TINY32 = 2.0**-24, 2.0**-53, 2.0**-126


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
    bound, docs/design.md invariant 12). Formed in float64 on float64 norms.

    ``abadi``: min(1, R_m/‖g‖) (Abadi et al. 2016). ``auto_s``: R_m/(‖g‖ + γ) and ``auto_v``:
    R_m/‖g‖ (paper 003, automatic clipping); each keeps ‖C·g‖ ≤ R_m, so the sensitivity bound is
    the same for all three. A zero gradient gets factor 0 under AUTO-V (any finite value would do).
    """
    r = group_thresholds(threshold, num_groups)
    if function == "abadi":
        return lambda norms: (r / norms).clamp(max=1.0) * scale
    if function == "auto_s":
        return lambda norms: r * scale / (norms + gamma)
    if function == "auto_v":
        return lambda norms: torch.where(norms > 0, r * scale / norms, torch.zeros_like(norms))
    raise ValueError(f"method.clipping: unknown clipping function {function!r}")


def sq_norms(rows: Tensor) -> Tensor:
    """‖x_i‖² [B] (float64) of every row x_i = ``rows[i]``, finite for every row of finite
    values: for float32 rows of more than ``BLOCKS_ABOVE`` elements in all, an upper
    bound a few parts per million above it; otherwise the float64 sum, within about n·10⁻¹⁶.

    Squares of float32 values overflow from 1.8e19 on, and a float32 sum of millions of
    squares loses ~1e-4 of its value; in float64 neither happens (a float32 value squared is
    at most 1.2e77). But converting a large input to float64 costs more than the rest of a
    logreg or mlp step's clipping on a 2-core machine. So large float32 inputs are summed in
    blocks of ``NORM_BLOCK`` elements, each in float32 (one pass over the input, no float64
    copy of it), the block sums added in float64 and raised by ``_float32_guard`` to a bound
    on the exact value. A row whose blocks overflow (or hold a NaN or an infinity) is summed
    in float64 instead (``_float64_sq_norms``), as small and non-float32 inputs are.

    On a GPU too: there the overflow check costs a host sync per call, but the float64 route
    converts ``NORM_CHUNK`` elements at a time, a few samples' gradients, and so launches a
    few kernels per sample: about 1,100 norms a step for resnet18 at B = 256 on an H100,
    whose DP step was bound by launching kernels (the blocks take a handful per call).
    """
    flat = in_memory_order(rows)[0].flatten(1)  # a norm is the same in any order
    length = flat.shape[1]
    blocks = flat.dtype == torch.float32 and length > 0
    if not blocks or flat.numel() <= BLOCKS_ABOVE:
        return _float64_sq_norms(flat)  # small: one float64 reduction makes fewer calls
    whole = length // NORM_BLOCK
    view = flat[:, : whole * NORM_BLOCK].reshape(len(flat), whole, NORM_BLOCK)
    norms = torch.linalg.vector_norm(view, dim=2)
    if whole * NORM_BLOCK < length:
        rest = torch.linalg.vector_norm(flat[:, whole * NORM_BLOCK :], dim=1, keepdim=True)
        norms = torch.cat([norms, rest], 1)
    bound = _float32_guard(norms.double().square().sum(1), length)
    if not bool(bound.sum() < math.inf):  # some bound NaN or infinite, or their sum overflows
        overflowed = ~bound.isfinite()
        bound[overflowed] = _float64_sq_norms(flat[overflowed])
    return bound


def _float32_guard(sums: Tensor, length: int) -> Tensor:
    """Raise the float64 sums of a row's squared float32 block norms r̂_b to a bound on the
    row's exact sum of squares S (Higham, *Accuracy and Stability of Numerical Algorithms*,
    §4.2: k floating-point additions of nonnegative terms, in any order, lose at most
    γ_k = k·u/(1 − k·u) of their sum).

    A block of m ≤ ``NORM_BLOCK`` elements takes m squares and m − 1 additions in float32 and
    a square root (and, in a norm algorithm that scales its terms, up to two more roundings a
    term), so r̂_b² ≥ S_b·(1 − γ_{m+8}) − 4m·2⁻¹²⁶: the last term for squares, sums and a
    square root whose input or result underflows, or is flushed to zero. Squaring the B block
    norms and adding them in float64 loses at most γ_{B+2} of their sum. So, for a row of n
    elements,

        S ≤ (Σ r̂_b² / (1 − γ_{B+2}) + 4n·2⁻¹²⁶) / (1 − γ_{m+8}),

    and a factor 1 + 16·2⁻⁵³ covers this bound's own float64 arithmetic (its constants, one
    product and one sum). For an ordinary row the bound is about 4.3 parts per million above
    the sum of the r̂_b².
    """

    def gamma(k: int, unit: float) -> float:
        return k * unit / (1 - k * unit)

    blocks = -(-length // NORM_BLOCK)
    summing = 1 - gamma(blocks + 2, U64)
    in_blocks = 1 - gamma(NORM_BLOCK + 8, U32)
    margin = 1 + 16 * U64
    return sums.mul_(margin / (summing * in_blocks)).add_(4 * length * TINY32 * margin / in_blocks)


def _float64_sq_norms(flat: Tensor) -> Tensor:
    """‖x_i‖² [B] of the rows of ``flat`` accumulated in float64, by blocks of at most
    ``NORM_CHUNK`` elements (the reduction converts its input whole: bounded transient
    memory)."""
    if flat.numel() <= NORM_CHUNK:
        return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64).square()
    cols = flat.shape[1]
    col_step = min(cols, NORM_CHUNK)
    row_step = max(1, NORM_CHUNK // col_step)
    out = []
    for i in range(0, flat.shape[0], row_step):
        block = flat[i : i + row_step]
        total = block.new_zeros(block.shape[0], dtype=torch.float64)
        for j in range(0, cols, col_step):
            part = block[:, j : j + col_step]
            total += torch.linalg.vector_norm(part, dim=1, dtype=torch.float64).square()
        out.append(total)
    return torch.cat(out)


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


def in_memory_order(x: Tensor) -> tuple[Tensor, list[int]]:
    """``x`` [B, …] with the axes after the first permuted into the order they lie in memory
    (a view), and that permutation: per-sample tensors formed in another layout than their
    axes' (``ConvRule``'s channels-last per-sample gradients) then flatten without a copy."""
    if x.is_contiguous():
        return x, list(range(x.dim()))
    order = [0, *sorted(range(1, x.dim()), key=lambda k: -x.stride(k))]
    return x.permute(order), order


def zero_rows(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` with the rows (first axis) where ``keep`` is false set to zero, out of place."""
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, 0)


def factors_as(coef: Tensor, dtype: torch.dtype) -> Tensor:
    """Clip factors in ``dtype``, clamped to its finite range.

    AUTO-V's R/‖g‖ exceeds the float32 range when ‖g‖ < R/3.4e38 (a record with subnormal
    features); an infinite factor would turn the zeros of g into NaN. Clamping lowers the factor,
    so ‖c·g‖ only shrinks, and c·|g_j| ≤ c·‖g‖ ≤ R keeps every product finite.
    """
    big = torch.finfo(dtype).max
    return coef.clamp(-big, big).to(dtype)
