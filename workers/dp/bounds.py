"""Proven float32 upper bounds on per-sample norms: the error analysis of every norm a step takes.

The clip factor of an example is computed from an upper bound ν ≥ ‖g‖ on its exact gradient norm,
so every clipped contribution c·g has norm at most R_m (docs/design.md, invariants 9 and 12) even
though no norm is computed exactly. Everything is float32 (no float64 on any device, and a
handful of operations a tensor); the rounding errors are folded into ν by constants computed here
from the shapes, once, in Python.

Model of the arithmetic (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
§2.2, §3.1, §4.2): each floating-point operation returns ``op(x, y)·(1 + δ) + η`` with
|δ| ≤ u = 2⁻²⁴ and |η| ≤ τ = 2⁻¹²⁶ (float32's smallest normal number: this covers gradual
underflow and flush-to-zero alike); a sum of n nonnegative terms in any order (the reduction
trees of CPU and GPU kernels, sequential or pairwise, with or without FMA) loses at most
γ_{n−1} = (n−1)u/(1 − (n−1)u) of its value. Matrix products use ``matmul_unit``: u in full float32,
the input rounding of TF32 or bfloat16 where torch is allowed to use them on a GPU.

Overflow. Squares of float32 values overflow from 1.8e19 on, and nothing here rescales rows (that
would cost operations a tensor on every step): an example whose bound is infinite or NaN (a NaN or
infinite value, or an exact norm of about 1.8e19 or more) gets clip factor 0 in its group and
contributes exactly zero (``workers.dp.clipping.clip_factors``, ``zero_rows``): within its bound,
as invariant 9 asks.

A ``Bound`` is a float32 tensor ``value`` [B] with two Python constants such that for every row i
whose value is finite, ``‖x_i‖ ≤ scale·value_i + floor`` in exact arithmetic. ``group_norms``
turns the bounds of a group's parameters into the one float32 ν per example that the clip factor
uses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

#: float32's unit roundoff and smallest normal number
U, TINY = 2.0**-24, 2.0**-126
#: a row of at most this many elements is reduced in one ``vector_norm``; longer ones by blocks
ONE_LEVEL = 1 << 12
#: roundings of the clip factor and of the clipped contribution that ν also covers: ν's own
#: two (``group_norms``), up to three in ``workers.dp.clipping.factor_fn`` (its constant's
#: conversion to float32, a division and AUTO-S's sum), one in c·g, and two to spare
CLIP_ROUNDINGS = 8
#: the per-position norms that enter the guard of a norm over several positions are raised by
#: ``SPREAD_FLOOR``·√(length) (see ``spread``)
SPREAD_FLOOR = 2.0**-20


def gamma(n: int, unit: float = U) -> float:
    """γ_n = n·u/(1 − n·u) (Higham, Lemma 3.1); infinite when n·u ≥ 1 (no bound: factor 0)."""
    return n * unit / (1 - n * unit) if n * unit < 1 else math.inf


def up32(x: float) -> float:
    """The smallest float32 ≥ ``x``: a constant that torch converts to float32 without lowering."""
    y = np.float32(x)
    if float(y) < x:
        y = np.nextafter(y, np.float32(np.inf))
    return float(y)


def matmul_unit(device: torch.device) -> float:
    """The unit roundoff of a float32 matrix product on ``device``: u, or the input rounding of
    TF32 (2⁻¹¹) or bfloat16 (2⁻⁸) where ``torch.set_float32_matmul_precision`` lets a GPU use
    them."""
    precision = torch.get_float32_matmul_precision()
    if device.type == "cpu" or precision == "highest":
        return U
    return 2.0**-11 if precision == "high" else 2.0**-8


@dataclass(frozen=True)
class Bound:
    """``‖x_i‖ ≤ scale·value_i + floor`` for every row i with a finite ``value_i`` [B] (float32)."""

    value: Tensor
    scale: float = 1.0
    floor: float = 0.0


@functools.cache
def _block(n: int) -> int:
    """Block length m of a row of n elements: n itself up to ``ONE_LEVEL``, else a power of two
    near √n, dividing n where one within a factor 16 of it does (no tail to reduce apart)."""
    if n <= ONE_LEVEL:
        return n
    m = 1 << (math.isqrt(n).bit_length() - 1)
    divides = min(m, n & -n)
    return divides if divides * 16 >= m else m


def _norm_constants(n: int, unit: float = U) -> tuple[float, float]:
    """(scale, floor) of one ``vector_norm`` r̂ of n values (any order, any precision ≥ float32):
    n squares and n − 1 additions lose γ_n of the sum S and (2n + 1)·τ to underflow, the square
    root's rounding 2 more u of r̂², a flushed subnormal input of it τ more, and a conversion of
    the values to float32 one more u, so S ≤ (r̂² + (2n + 2)·τ)/(1 − γ_{n+3}) and
    ‖x‖ ≤ (r̂ + √((2n + 2)τ))/√(1 − γ_{n+3})."""
    scale = 1 / math.sqrt(1 - gamma(n + 3, unit))
    return scale, scale * math.sqrt((2 * n + 2) * TINY)


def row_norms(rows: Tensor) -> Bound:
    """A bound on ‖x_i‖ of every row x_i = ``rows[i]`` (any shape [B, …], float32 or a lower
    precision, in memory order: a norm is the same in any order). A clipping group's flat
    buffer of per-sample gradients (``workers.dp.clipping.FlatRows``) is one such row of D
    values, its parameters' concatenation: the same analysis with n = D.

    Rows of n ≤ ``ONE_LEVEL`` elements take one ``vector_norm`` (``_norm_constants``). Longer ones
    are cut into q blocks of m (``_block``, plus a tail when m does not divide n): block norms r̂_b,
    then the norm R̂ of those; each level is a ``vector_norm`` as above, so

        S ≤ (R̂² + (2q + 2)τ)/(1 − γ_{q+2}) / (1 − γ_{m+3}) + q(2m + 2)τ/(1 − γ_{m+3}),

    i.e. ‖x‖ ≤ s·R̂ + f with s = 1/√((1 − γ_{q+2})(1 − γ_{m+3})), f = s·√((2n + 4q + 4)τ): about
    1.2e-4 above the norm for n ≤ 2²⁴, against γ_n (up to 1) for one flat reduction.
    """
    flat = _memory_order(rows).flatten(1)
    n = flat.shape[1]
    if n == 0:
        return Bound(flat.new_zeros(flat.shape[0]))
    m = _block(n)
    if m == n:
        scale, floor = _norm_constants(n)
        return Bound(_norm(flat, 1), scale, floor)
    q, rest = divmod(n, m)
    blocks = _norm(flat[:, : q * m].reshape(len(flat), q, m), 2)
    if rest:
        blocks, q = torch.cat([blocks, _norm(flat[:, q * m :], 1).unsqueeze(1)], 1), q + 1
    scale = 1 / math.sqrt((1 - gamma(q + 2)) * (1 - gamma(m + 3)))
    return Bound(_norm(blocks, 1), scale, scale * math.sqrt((2 * n + 4 * q + 4) * TINY))


def _norm(x: Tensor, dim: int) -> Tensor:
    """The float32 2-norm over ``dim`` (values of another dtype are rounded to float32 first)."""
    if x.dtype == torch.float64:  # ``vector_norm`` refuses a narrowing ``dtype``
        x = x.float()
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)


def _memory_order(x: Tensor) -> Tensor:
    """``x`` with its axes after the first in the order they lie in memory (a view where that
    makes it contiguous: per-sample gradients formed channels-last then flatten without a copy)."""
    if x.is_contiguous():
        return x
    return x.permute(0, *sorted(range(1, x.dim()), key=lambda k: -x.stride(k)))


def raised(bound: Bound) -> Bound:
    """The same bound with its floor folded into the value: ``value + floor/scale``, rounded
    (the floor is at least √(4τ), so the sum is a normal number and rounds by at most u)."""
    if not bound.floor:
        return bound
    return Bound(bound.value + up32(bound.floor / bound.scale), bound.scale / (1 - U))


def product(a: Bound, b: Bound) -> Bound:
    """A bound on ‖a_i‖·‖b_i‖ (the norm of a rank-one gradient g_i a_iᵀ): the product of the
    raised values, one more rounding (a product of two raised values is at least 4τ: normal)."""
    ra, rb = raised(a), raised(b)
    return Bound(ra.value * rb.value, ra.scale * rb.scale / (1 - U))


def from_squares(squares: Tensor, scale: float) -> Bound:
    """A bound on ‖x_i‖ from ``squares`` ≥ ‖x_i‖²/``scale`` (normal numbers: every guarded
    square here is at least 2⁻¹⁰⁴): its square root rounds by at most u."""
    return Bound(squares.sqrt(), math.sqrt(scale) / (1 - U))


def group_norms(bounds: Sequence[Bound]) -> Tensor:
    """ν [B] (float32) with ‖x_i‖ ≤ ν_i for the concatenation x_i of the rows that ``bounds``
    bound (a clipping group's parameters), for every i with a finite ν_i, raised by enough that
    the clip factor's and the contribution's roundings stay covered (``CLIP_ROUNDINGS``).

    With P bounds, N̂ = ``vector_norm`` of their values (``_norm_constants`` with n = P) and the
    triangle inequality in ℝ^P, ‖x_i‖ ≤ ‖(s_p v_p + f_p)_p‖ ≤ s·‖v‖ + ‖f‖ ≤ k₁·N̂ + k₂ with
    s = max s_p, k₁ = s·s_P, k₂ = s·f_P + ‖f‖. ν = fl(fl(N̂·k₁) + k₂) (or fl(N̂·k₁ + k₂), one
    rounding, where the one operation that forms it fuses them) with both constants rounded up
    and raised by 1/(1 − ``CLIP_ROUNDINGS``·u): two roundings for ν, the rest for c·g.
    """
    if len(bounds) == 1:
        (only,) = bounds
        values, k1, k2 = only.value, only.scale, only.floor
    else:
        values = torch.linalg.vector_norm(torch.stack([b.value for b in bounds], 1), dim=1)
        s_p, f_p = _norm_constants(len(bounds))
        s = max(b.scale for b in bounds)
        k1, k2 = s * s_p, s * f_p + math.hypot(*(b.floor for b in bounds))
    slack = 1 / (1 - CLIP_ROUNDINGS * U)
    # τ more: N̂·k₁ may underflow when k₂ covers nothing (a bound without a floor); k₂ as a
    # 0-dim tensor (exact: a float32 value) so that k₂ + k₁·N̂ is one operation
    floor = torch.tensor(up32(k2 * slack + TINY), dtype=torch.float32)
    return torch.add(floor, values, alpha=up32(k1 * slack))


def spread(
    norms_a: Tensor | None, norms_g: Tensor, d: int, p: int, unit_a: float = U
) -> tuple[Tensor, float]:
    """(Ŝ, s) with s·Ŝ_i ≥ S_i = Σ_t ‖a_t‖·‖g_t‖ for one map over T positions, from the float32
    per-position norms ``norms_a`` [..., T] of rows of d values (None: one-hot rows, norm 1
    exactly) and ``norms_g`` [..., T] of p; ``unit_a``: the unit of the squares and sums under
    ``norms_a`` (a Gram matrix's diagonal comes from a matrix product).

    Each norm is raised to r̂ + σ with σ = ``SPREAD_FLOOR``·√length ≥ 2·f/s (``_norm_constants``),
    so s·(r̂ + σ) ≥ max(‖a_t‖, s·σ/2): an upper bound on the norm, and at least σ/2. That floor
    keeps Ŝ² ≥ T²·σ_a²σ_g² ≥ 2⁻⁸⁰ (its guard never underflows) and bounds what the Gram matrices
    and instantiated gradients lose to underflow by a tiny multiple of Ŝ² (``ghost_guard``)."""
    s_g, _ = _norm_constants(p)
    positions = norms_g.shape[-1]
    rg = norms_g + up32(SPREAD_FLOOR * math.sqrt(p))
    if norms_a is None:  # T − 1 additions, one rounding of the raised norms
        return rg.sum(-1), s_g / (1 - gamma(positions + 1))
    s_a, _ = _norm_constants(d, unit_a)
    ra = norms_a + up32(SPREAD_FLOOR * math.sqrt(d))
    # two roundings for the raised norms, one a product, T − 1 additions
    return (ra * rg).sum(-1), s_a * s_g / (1 - gamma(positions + 2))


def ghost_guard(d: int, p: int, positions: int, sum_rows: int, unit: float) -> float:
    """κ of the guard κ·s²·Ŝ² added to a ghost norm Σ_{t,s}(a_t·a_s)(g_t·g_s) over T > 1
    positions (Li et al. 2021; Bu et al. 2022a), computed in float32 with matrix products of unit
    ``unit``, so that ν² ≥ (‖G‖ + γ_sum·S)², S = Σ_t ‖a_t‖‖g_t‖ ≥ ‖G‖ (triangle inequality).

    - Gram entries are dot products of length d and p: within γ_d(unit)·‖a_t‖‖a_s‖ + 2dτ and
      γ_p(unit)·‖g_t‖‖g_s‖ + 2pτ; their T² products, summed, add γ_{T²+1} of the sum of
      magnitudes. Relative part: γ_{d+p+T²+1}·S² (Higham's γ_j + γ_k + γ_jγ_k ≤ γ_{j+k}).
    - Underflow part: 2τ(d·(Σ_t‖g_t‖)² + p·(Σ_t‖a_t‖)²) + 3T²τ ≤ 2⁻⁴⁰·s²Ŝ², since every
      raised position norm is at least σ/2 (``spread``).
    - The clipped sum (book-keeping, paper 002 eq. 3) adds at most ``sum_rows`` (sample,
      position) rows a chunk, so sample i's part is within γ_{n_s+1}·c_i·S_i of c_i·G_i; with
      ‖G‖ ≤ S, ν² = ghost + κS² ≥ (‖G‖ + γ_{n_s+1}S)² once κ covers 2γ_{n_s+1} + γ_{n_s+1}².
    - The guard's own float32 arithmetic rounds by a few u: ``guarded_scale``.
    """
    norm = gamma(d + p + positions * positions + 1, unit)
    summed = gamma(sum_rows + 1, unit)
    return norm + 2 * summed + summed * summed + 2.0**-40


#: η of ``instantiated_guard``: (x + εS)² ≤ (1 + η)x² + (1 + 1/η)ε²S²
ETA = 2.0**-10


def instantiated_guard(positions: int, sum_rows: int, unit: float) -> float:
    """κ' of a norm over T > 1 positions from the instantiated gradient M̂ (each entry a sum of
    at most T terms of unit ``unit``), as ν² = (1 + ``ETA``)·x̂² + κ'·s²Ŝ², x̂ a bound on ‖M̂‖.

    ‖M̂ − G‖ ≤ γ_T(unit)·S; the sum adds γ_{n_s+1}·S (as in ``ghost_guard``); underflow loses
    2Tτ an entry, at most 2⁻⁴⁰·S (``spread``'s floors); so with ε = γ_T + γ_{n_s+1} + 2⁻⁴⁰,
    ‖G‖ + γ_{n_s+1}S ≤ x + εS and (x + εS)² ≤ (1 + η)x² + (1 + 1/η)ε²S²."""
    eps = gamma(positions, unit) + gamma(sum_rows + 1, unit) + 2.0**-40
    return (1 + 1 / ETA) * eps * eps


def guarded_scale(terms: int) -> float:
    """1/(1 − γ_{5+terms}): a guarded square (a square, two products, a sum) and the adding of
    ``terms`` of them (conv groups) stay an upper bound."""
    return 1 / (1 - gamma(5 + terms))


def over_maps(bound: Bound, maps: int) -> Bound:
    """A bound over the B rows of ``bound``'s B·``maps`` values (G maps a sample, in order):
    the norm of each sample's ``maps`` values (``_norm_constants``), scaled."""
    if maps == 1:
        return bound
    s, f = _norm_constants(maps)
    raised_bound = raised(bound)
    values = torch.linalg.vector_norm(raised_bound.value.view(-1, maps), dim=1)
    return Bound(values, raised_bound.scale * s, raised_bound.scale * f)


def cat(parts: Sequence[Bound]) -> Bound:
    """Bounds of consecutive chunks of samples as one bound."""
    if len(parts) == 1:
        return parts[0]
    return Bound(
        torch.cat([b.value for b in parts]),
        max(b.scale for b in parts),
        max(b.floor for b in parts),
    )
