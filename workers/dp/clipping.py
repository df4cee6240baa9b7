"""Clipping groups and clipping functions.

Group-wise clipping (paper 002, eq. 4): the trainable parameters are split into M groups; the
per-sample gradient restricted to group m is clipped at R_m = R/√M, so the concatenated clipped
gradient has norm at most ‖[R_1, …, R_M]‖₂ = R and one Gaussian noise of std σR covers all groups.
(Paper 002's Algorithm 1 drops the 1/√M, which would make the sensitivity √M·R; we follow eq. 4.)

Hostile records (docs/design.md, invariant 9) are handled here for both clippers: squared norms are
accumulated in float64 (``sq_norms``), so a finite example gets a finite norm even when its
squared norm overflows float32; an example gets clip factor 0 in every group where its norm is
not finite (``clip_factors``), and its rows are zeroed before any product that adds to such a
group (``zero_rows``), since 0·NaN = NaN; factors are cast to the gradients' dtype without
overflowing (``factors_as``). Zeroing a group never raises the sensitivity: every example still
adds at most R_m to each group, so at most R in all.
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
    function: ClippingFunction, threshold: float, num_groups: int, gamma: float = 0.01
) -> CoefFn:
    """The per-sample, per-group clip factor C(g; R_m) as a function of norms [B, k], elementwise.

    ``abadi``: min(1, R_m/‖g‖) (Abadi et al. 2016). ``auto_s``: R_m/(‖g‖ + γ) and ``auto_v``:
    R_m/‖g‖ (paper 003, automatic clipping); each keeps ‖C·g‖ ≤ R_m, so the sensitivity bound is
    the same for all three. A zero gradient gets factor 0 under AUTO-V (any finite value would do).
    """
    r = group_thresholds(threshold, num_groups)
    if function == "abadi":
        return lambda norms: (r / norms).clamp(max=1.0)
    if function == "auto_s":
        return lambda norms: r / (norms + gamma)
    if function == "auto_v":
        return lambda norms: torch.where(norms > 0, r / norms, torch.zeros_like(norms))
    raise ValueError(f"method.clipping: unknown clipping function {function!r}")


def sq_norms(rows: Tensor) -> Tensor:
    """‖x_i‖² [B] of every row x_i = ``rows[i]``, accumulated in float64.

    Squares of float32 values overflow from 1.8e19 on, and a float32 sum of millions of
    squares loses ~1e-4 of its value; in float64 neither happens (a float32 value squared is
    at most 1.2e77). The float64 reduction converts its input whole, so it runs on blocks of
    at most ``NORM_CHUNK`` elements: bounded transient memory.
    """
    flat = rows.flatten(1)
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
    return torch.where(norms.isfinite() & coef.isfinite(), coef, 0)


def clipped_sum(coef: Tensor, per_sample: Tensor) -> Tensor:
    """Σ_i coef[i] · per_sample[i] [B, …] → […], in the per-sample tensor's dtype."""
    return torch.tensordot(factors_as(coef, per_sample.dtype), per_sample, dims=1)


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
