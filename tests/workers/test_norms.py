"""``workers.dp.bounds``: float32 upper bounds on per-sample norms, against exact values.

Exact values are independent of torch's reductions: ``math.fsum`` of the float64 squares of
float32 values (exact: a float32 value squared fits float64's significand), and for norms over
positions the exact gradient Σ_t g_t a_tᵀ formed with ``fractions.Fraction``-free float64 products
(exact) summed by ``math.fsum``. Every bound must be at least the exact norm, and, for ordinary
rows, within a small relative margin of it; rows of many shapes and scales: Gaussian,
heavy-tailed, magnitudes from 1e-18 to 1e18, subnormal, huge (up to 1e18 per value, and 3e38,
whose squares overflow: no claim, the bound must then be infinite), absorption of small squares
by large ones. ``clip_factors``: zero wherever a norm or a factor is not finite."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.dp import bounds, clipping
from workers.dp.clipping import clipped_sum, in_memory_order
from workers.dp.ghost.layers import positions_norms

#: how far above the exact norm a row bound may be (``row_norms``: about 1.2e-4 at worst)
TIGHT = 3e-4
#: norms from which a block's float32 sum of squares may overflow: no finite bound is promised
OVERFLOWS = 1.8e19
KINDS = ["gaussian", "heavy_tailed", "wide_range", "absorption", "subnormal", "huge", "mixed"]
LENGTHS = [1, 7, 64, 4096, 4097, 5000, 65536 + 3, 1 << 17]


def exact(rows: torch.Tensor) -> list[float]:
    """‖x‖ of each row: the correctly rounded sum of the exact float64 squares, its square root
    (within one float64 rounding of the exact norm)."""
    return [math.sqrt(math.fsum(float(v) ** 2 for v in row)) for row in rows.flatten(1).double()]


def as_upper(bound: bounds.Bound) -> list[float]:
    """The bound in float64: scale·value + floor, rounded up a little (its own arithmetic)."""
    return [(bound.scale * v + bound.floor) * (1 + 1e-15) for v in bound.value.double().tolist()]


def rows_of(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g)
    if kind == "heavy_tailed":  # Cauchy: a few entries dominate each row
        return torch.tan(torch.pi * (torch.rand(3, n, generator=g) - 0.5))
    if kind == "wide_range":
        return x * 10.0 ** torch.randint(-18, 19, (3, n), generator=g)
    if kind == "subnormal":  # squares of these underflow float32 wholly
        return x * 1e-40
    if kind == "huge":  # squares up to 1e36: finite in float32 as long as their sum is
        return x.sign() * 1e18 / math.sqrt(n)
    if kind == "mixed":  # signs, subnormals, tiny and large values in one row
        return x * torch.tensor([1e-40, 1e-20, 1.0, 1e15])[torch.randint(0, 4, (3, n), generator=g)]
    if kind == "absorption":  # one large square and many that round away when added to it
        row = torch.full((n,), 2.0**-12)
        row[:: max(1, n // 3)] = 1.0
        return torch.stack([row, -row, row.roll(7)])
    return x


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_row_norms_bound_every_row_closely(kind: str, n: int) -> None:
    rows = rows_of(kind, n)
    bound = bounds.row_norms(rows)
    assert bound.value.dtype == torch.float32 and bound.value.shape == (len(rows),)
    for got, true in zip(as_upper(bound), exact(rows), strict=True):
        assert true <= got, (kind, n, got, true)
        if true < OVERFLOWS:
            assert got <= true * (1 + TIGHT) + bound.floor * 2, (kind, n, got, true)


@pytest.mark.parametrize("value", [3e38, -3e38, 1e20, math.inf, -math.inf, math.nan])
def test_rows_whose_squares_overflow_or_are_not_finite_get_no_finite_bound(value: float) -> None:
    rows = torch.randn(3, 5000)
    rows[1, 17] = value
    norms = bounds.group_norms([bounds.row_norms(rows)])
    assert norms[0].isfinite() and norms[2].isfinite() and not norms[1].isfinite()


@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_group_norms_bound_the_concatenation_with_the_clip_factors_roundings(
    kind: str, parts: int
) -> None:
    """ν ≥ ‖x‖·(1 + ``CLIP_ROUNDINGS``·u)-ish: at least the exact norm of the group's rows
    together, raised by what the clip factor's and the product's roundings need."""
    pieces = [rows_of(kind, n) for n in (3, 4097, 100, 1 << 13, 9)[:parts]]
    nu = bounds.group_norms([bounds.row_norms(p) for p in pieces]).double().tolist()
    whole = torch.cat([p.flatten(1) for p in pieces], 1)
    slack = 1 + 6 * bounds.U  # the roundings of c and of c·g that ν must cover beyond ‖x‖
    for got, true in zip(nu, exact(whole), strict=True):
        assert true * slack <= got, (kind, got, true)
        if true < OVERFLOWS:
            assert got <= true * (1 + TIGHT) + 1e-15, (kind, got, true)


def exact_positions_norm(a: torch.Tensor, g: torch.Tensor) -> list[float]:
    """(Σ_k ‖Σ_t g_{t,k} a_{t,k}ᵀ‖²)^½ per sample, each entry summed exactly (``math.fsum``)."""
    out = []
    for ai, gi in zip(a.double(), g.double(), strict=True):  # [G, T, d], [G, T, p]
        products = gi.unsqueeze(-1) * ai.unsqueeze(-2)  # [G, T, p, d], each exact in float64
        entries = products.permute(0, 2, 3, 1).reshape(-1, products.shape[1]).tolist()
        out.append(math.sqrt(math.fsum(math.fsum(e) ** 2 for e in entries)))
    return out


def spread_of(a: torch.Tensor, g: torch.Tensor) -> list[float]:
    """S_i = Σ_t ‖a_t‖‖g_t‖ summed over maps: the scale of the rounding guard."""
    return (a.double().norm(dim=-1) * g.double().norm(dim=-1)).sum((1, 2)).tolist()


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e8])
@pytest.mark.parametrize(
    ("maps", "positions", "d", "p"), [(1, 1, 5, 3), (1, 6, 4, 3), (2, 9, 3, 5)]
)
def test_norms_over_positions_bound_the_exact_gradient(
    monkeypatch: pytest.MonkeyPatch,
    ghost: bool,
    scale: float,
    maps: int,
    positions: int,
    d: int,
    p: int,
) -> None:
    """Ghost and instantiated norms (forced), plus the cancelling example (M·v, M·v + δ with
    output gradients +w, −w): at least the exact norm plus what the clipped sum may add by
    rounding (γ·S), and close to the exact norm where nothing cancels."""
    monkeypatch.setattr("workers.dp.ghost.layers.use_ghost", lambda *_: ghost)
    gen = torch.Generator().manual_seed(positions * d)
    a = torch.randn(4, maps, positions, d, generator=gen) * scale
    g = torch.randn(4, maps, positions, p, generator=gen)
    if positions > 1:  # sample 3 cancels: its gradient is -w δᵀ, tiny against its terms
        a[3, :, 1] = a[3, :, 0] + 1e-6 * scale
        g[3, :, 1] = -g[3, :, 0]
        a[3, :, 2:], g[3, :, 2:] = 0, 0
    bound = positions_norms(a, g)
    got = as_upper(bound)
    for i, (true, spread) in enumerate(
        zip(exact_positions_norm(a, g), spread_of(a, g), strict=True)
    ):
        assert true + (0 if positions == 1 else bounds.gamma(5) * spread) <= got[i], (
            i,
            got[i],
            true,
        )
        if i < 3 and positions == 1:
            assert got[i] <= true * (1 + TIGHT) + 1e-15
        elif i < 3:  # the guard: at most √κ·S above, and its floors (2⁻²⁰ a norm) absolutely
            assert got[i] <= true + 0.05 * spread + 1e-5


@pytest.mark.parametrize("n", [3, 4096 + 5])
def test_rows_laid_out_in_another_order_are_read_in_place(n: int) -> None:
    """Per-sample tensors whose memory order is not their axes' (channels-last convolution
    gradients, a permuted view): norms and clipped sums as of the same values laid out in
    order, with no copy of the rows."""
    g = torch.Generator().manual_seed(n)
    stored = torch.randn(4, 5, n, 3, generator=g)  # [B, O, k, C] in memory
    rows = stored.permute(0, 1, 3, 2)  # [B, O, C, k]
    ordered = rows.contiguous()
    view, order = in_memory_order(rows)
    assert order == [0, 1, 3, 2] and view.flatten(1).data_ptr() == stored.data_ptr()
    for got, true in zip(as_upper(bounds.row_norms(rows)), exact(ordered), strict=True):
        assert true <= got <= true * (1 + TIGHT)
    coef = torch.rand(4, generator=g)
    total = clipped_sum(coef, rows)
    assert total.shape == (5, 3, n)
    expected = (coef.double().view(-1, 1, 1, 1) * ordered.double()).sum(0)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-5)


def test_empty_rows_and_empty_batches() -> None:
    assert torch.equal(bounds.row_norms(torch.zeros(3, 0)).value, torch.zeros(3))
    assert bounds.row_norms(torch.zeros(0, 5)).value.shape == (0,)
    assert bounds.group_norms([bounds.row_norms(torch.zeros(0, 2, 3))]).shape == (0,)


def test_constants_round_up_to_float32() -> None:
    for x in (1.0, 1 + 1e-9, math.pi, 2.0**-126 * 3.3, 1e-45):
        y = bounds.up32(x)
        assert y >= x and torch.tensor(y, dtype=torch.float32).item() == y
    assert bounds.gamma(2**24) == math.inf


def test_clip_factors_are_zero_wherever_the_norm_or_the_factor_is_not_finite() -> None:
    """``clip_factors`` against a plain elementwise rule: a factor survives only where both the
    norm and the factor are finite, and it survives unchanged. ``keep_all`` answers 1 even for
    a NaN or infinite norm, so only the norm's own check can zero those."""
    inf, nan = math.inf, math.nan
    norms = torch.tensor([[0.0, 0.5], [2.0, inf], [nan, 3.0], [1e-40, 1e30]])

    def keep_all(n: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(n)

    def wild(n: torch.Tensor) -> torch.Tensor:  # a NaN, ±inf and finite factors
        return torch.tensor([[nan, 2.0], [-inf, 0.25], [1.0, inf], [7.0, -0.5]], dtype=n.dtype)

    for coef_fn in (keep_all, wild, clipping.coefficient_fn("auto_v", 1.0, 2)):
        coef = coef_fn(norms)
        flat = zip(norms.flatten().tolist(), coef.flatten().tolist(), strict=True)
        expected = [c if math.isfinite(n) and math.isfinite(c) else 0.0 for n, c in flat]
        assert clipping.clip_factors(coef_fn, norms).flatten().tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    function=st.sampled_from(["abadi", "auto_s", "auto_v"]),
    threshold=st.floats(1e-6, 1e6),
    groups=st.integers(1, 8),
    scale=st.sampled_from(["one", "per_threshold", "per_batch"]),
    log_norms=st.lists(st.floats(-45, 38.5), min_size=1, max_size=16),
)
def test_a_clip_factor_is_its_rule_within_its_roundings(
    function: str, threshold: float, groups: int, scale: str, log_norms: list[float]
) -> None:
    """The float32 factor against the rule computed in float64 from the same float32 norms
    (zero, subnormal, up to float32's largest): within the ``CLIP_ROUNDINGS`` − 3 roundings
    the norm bound leaves it (its own, and one of c·g), and c·ν ≤ R_m·scale to as many, which
    is what keeps a contribution in its bound."""
    s = {"one": 1.0, "per_threshold": 1 / threshold, "per_batch": 1 / 256}[scale]
    norms = torch.tensor([0.0, *(10.0**x for x in log_norms)], dtype=torch.float32)
    factors = clipping.coefficient_fn(function, threshold, groups, scale=s)(norms.unsqueeze(1))
    assert factors.dtype == torch.float32
    r = clipping.group_thresholds(threshold, groups)
    slack = (bounds.CLIP_ROUNDINGS - 3) * bounds.U
    for nu, c in zip(norms.double().tolist(), factors[:, 0].double().tolist(), strict=True):
        rule = {
            "abadi": min(1.0, r / nu) * s if nu > 0 else s,
            "auto_s": r * s / (nu + 0.01),
            "auto_v": r * s / nu if nu > 0 else 0.0,
        }[function]
        if rule < bounds.TINY or rule > 3e38 or not math.isfinite(c):
            continue  # out of float32's normal range: no relative claim
        assert abs(c - rule) <= slack * rule, (nu, c, rule)
        assert c * nu <= r * s * (1 + slack), (nu, c)
