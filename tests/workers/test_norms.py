"""``workers.dp.clipping.sq_norms``. On float32 blocks (large inputs; forced here on small ones):
an upper bound on every row's squared norm, within a few parts per million, checked against
exact sums (``math.fsum`` of the float64 squares of float32 values, which are exact) on
ordinary, heavy-tailed, wide-ranging and adversarial rows; hostile rows (NaN, ±inf, squares
that overflow or underflow float32) as the float64 path gives them. Small inputs and other
dtypes: the float64 path itself. ``clip_factors``: zero wherever a norm or a factor is not
finite."""

from __future__ import annotations

import math

import pytest
import torch

from workers.dp import clipping
from workers.dp.clipping import (
    BLOCKS_ABOVE,
    NORM_BLOCK,
    _float64_sq_norms,
    clipped_sum,
    in_memory_order,
    sq_norms,
)

TIGHT = 1e-5  # how far above the exact value the bound may be


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float32 input, however small, takes the float32 blocks."""
    monkeypatch.setattr(clipping, "BLOCKS_ABOVE", 0)


def exact(rows: torch.Tensor) -> list[float]:
    """Σ x² of each row, correctly rounded (a float32 value squared is exact in float64)."""
    return [math.fsum(float(v) ** 2 for v in row) for row in rows.flatten(1).double()]


def rows_of(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "gaussian":
        return torch.randn(4, n, generator=g)
    if kind == "heavy_tailed":  # Cauchy: a few entries dominate each row
        return torch.tan(torch.pi * (torch.rand(4, n, generator=g) - 0.5))
    if kind == "wide_range":  # magnitudes from 1e-18 to 1e18, no float32 overflow
        return torch.randn(4, n, generator=g) * 10.0 ** torch.randint(-18, 19, (4, n), generator=g)
    # absorption: one large square and many that round away when added to it in float32
    row = torch.full((n,), 2.0**-12)
    row[:: max(1, n // 3)] = 1.0
    return torch.stack([row, row.flip(0), -row, row.roll(7)])


@pytest.mark.parametrize("n", [1, NORM_BLOCK - 1, NORM_BLOCK, NORM_BLOCK + 1, 3072, 9217])
@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "wide_range", "absorption"])
def test_float32_rows_get_a_tight_upper_bound(blocks: None, kind: str, n: int) -> None:
    rows = rows_of(kind, n)
    bound = sq_norms(rows)
    assert bound.dtype == torch.float64 and bound.shape == (len(rows),)
    for got, true in zip(bound.tolist(), exact(rows), strict=True):
        assert true <= got <= true * (1 + TIGHT), (got, true)


def test_the_bound_holds_where_float32_additions_lose_terms(blocks: None) -> None:
    """Each block's float32 sum drops whole terms here (2⁻²⁴ added to 1 rounds back to 1); the
    guard must still leave the result above the exact sum."""
    row = torch.full((1, 4 * NORM_BLOCK), 2.0**-12)
    row[0, ::NORM_BLOCK] = 1.0
    assert sq_norms(row).item() >= exact(row)[0]


def test_hostile_rows_are_as_on_the_float64_path_and_leave_the_others_alone(
    blocks: None,
) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 300, generator=g)
    rows[1, 3] = math.nan
    rows[2, 5] = math.inf
    rows[3, 9] = -math.inf
    rows[4] = 1e20  # finite, but its squares overflow float32
    rows[5] = 1e-40  # subnormal: its squares underflow float32
    bound = sq_norms(rows)
    assert math.isnan(bound[1]) and bound[2] == bound[3] == math.inf
    assert bound[4].isfinite() and bound[4] >= exact(rows[4:5])[0]
    assert bound[4] == _float64_sq_norms(rows[4:5])[0]
    assert bound[5].isfinite() and 0 < exact(rows[5:6])[0] <= bound[5]
    for i in (0, 6):
        assert bound[i] == sq_norms(rows[i : i + 1])[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes_are_summed_in_float64(dtype: torch.dtype) -> None:
    rows = torch.randn(3, 200).to(dtype)
    assert torch.equal(sq_norms(rows), _float64_sq_norms(rows))


def test_large_inputs_take_the_blocks_and_small_ones_the_float64_path() -> None:
    large = torch.randn(BLOCKS_ABOVE // 1000 + 1, 1000)
    bound, exact64 = sq_norms(large), _float64_sq_norms(large)
    assert (bound > exact64).all() and (bound <= exact64 * (1 + TIGHT)).all()
    small = torch.randn(BLOCKS_ABOVE // 1000, 1000)
    assert torch.equal(sq_norms(small), _float64_sq_norms(small))


def test_no_input_larger_than_blocks_above_is_copied_to_float64() -> None:
    """The float64 path converts its input whole; above ``BLOCKS_ABOVE`` that transient set a
    small model's peak memory (mlp's 64 × 3072 input: 1.5 MB against a 5-MB step), so no
    allocation while summing such an input may reach its float64 size."""
    rows = torch.randn(64, 3072)
    assert rows.numel() > BLOCKS_ABOVE
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        sq_norms(rows)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert 0 < largest < rows.numel() * 8 / 4


def test_empty_rows_and_empty_batches(blocks: None) -> None:
    assert torch.equal(sq_norms(torch.zeros(3, 0)), torch.zeros(3, dtype=torch.float64))
    assert sq_norms(torch.zeros(0, 5)).shape == (0,)
    assert sq_norms(torch.zeros(0, 2, 3)).shape == (0,)


@pytest.mark.parametrize("n", [3, NORM_BLOCK + 5])
def test_rows_laid_out_in_another_order_are_read_in_place(blocks: None, n: int) -> None:
    """Per-sample tensors whose memory order is not their axes' (channels-last convolution
    gradients, a permuted view): norms and clipped sums as of the same values laid out in
    order, with no copy of the rows."""
    g = torch.Generator().manual_seed(n)
    stored = torch.randn(4, 5, n, 3, generator=g)  # [B, O, k, C] in memory
    rows = stored.permute(0, 1, 3, 2)  # [B, O, C, k]
    ordered = rows.contiguous()
    view, order = in_memory_order(rows)
    assert order == [0, 1, 3, 2] and view.flatten(1).data_ptr() == stored.data_ptr()
    bound = sq_norms(rows)
    assert all(
        e <= b <= e * (1 + TIGHT) for b, e in zip(bound.tolist(), exact(ordered), strict=True)
    )
    coef = torch.rand(4, generator=g, dtype=torch.float64)
    total = clipped_sum(coef, rows)
    assert total.shape == (5, 3, n)
    expected = (coef.view(-1, 1, 1, 1) * ordered.double()).sum(0)
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-6)


def test_clip_factors_are_zero_wherever_the_norm_or_the_factor_is_not_finite() -> None:
    """``clip_factors`` against a plain elementwise rule: a factor survives only where both the
    norm and the factor are finite, and it survives unchanged. ``keep_all`` answers 1 even for
    a NaN or infinite norm, so only the norm's own check can zero those."""
    inf, nan = math.inf, math.nan
    norms = torch.tensor([[0.0, 0.5], [2.0, inf], [nan, 3.0], [1e-320, 1e300]], dtype=torch.float64)

    def keep_all(n: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(n)

    def wild(n: torch.Tensor) -> torch.Tensor:  # a NaN, ±inf and finite factors
        return torch.tensor([[nan, 2.0], [-inf, 0.25], [1.0, inf], [7.0, -0.5]], dtype=n.dtype)

    for coef_fn in (keep_all, wild, clipping.coefficient_fn("auto_v", 1.0, 2)):
        coef = coef_fn(norms)
        flat = zip(norms.flatten().tolist(), coef.flatten().tolist(), strict=True)
        expected = [c if math.isfinite(n) and math.isfinite(c) else 0.0 for n, c in flat]
        assert clipping.clip_factors(coef_fn, norms).flatten().tolist() == expected
