"""One flat buffer per clipping group (``workers.dp.clipping.FlatRows``) and the per-sample
gradients the fast path forms in one operation (GroupNorm by torch's group-norm backward, a
position embedding by one ``index_put_``), against sums and norms formed tensor by tensor.

A group's instantiated per-sample gradients are clipped together: one norm bound over their
concatenation (at least the exact norm), hostile rows zeroed once, one product for every sum,
split back into each parameter's buffer (views, permuted layouts and single tensors alike)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from workers.dp import bounds
from workers.dp.clipping import FlatRows
from workers.dp.ghost import clipped_grad_sum, clipper
from workers.dp.ghost.layers import RULES, Call
from workers.dp.grads import per_sample_grads

SHAPES = [(3,), (4, 5), (2, 3, 3), (1,), (6, 1, 2)]
LOSS = nn.CrossEntropyLoss(reduction="none")


def _parts(seed: int, count: int, permuted: bool) -> list[Tensor]:
    """``count`` per-sample tensors [B, …] of varied shapes, every other one laid out in another
    order than its axes' (as channels-last per-sample convolution gradients are)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for k in range(count):
        shape = SHAPES[(seed + k) % len(SHAPES)]
        x = torch.randn(6, *shape, generator=g) * 10.0 ** float(torch.randint(-3, 4, ()))
        if permuted and k % 2 and x.dim() > 2:
            x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # same values, other memory order
        parts.append(x)
    return parts


def _exact_norms(parts: list[Tensor]) -> list[float]:
    rows = torch.cat([p.reshape(len(p), -1) for p in parts], 1).double()
    return [math.sqrt(math.fsum(float(v) ** 2 for v in row)) for row in rows]


@pytest.mark.parametrize("hostile", [None, float("nan"), float("inf"), 3e38])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("count", [1, 2, 5])
@pytest.mark.parametrize("seed", range(4))
def test_one_buffer_gives_each_tensors_clipped_sum_and_a_bound_on_their_joint_norm(
    seed: int, count: int, permuted: bool, hostile: float | None
) -> None:
    parts = _parts(seed, count, permuted)
    if hostile is not None:
        parts[-1][(2,) + (0,) * (parts[-1].dim() - 1)] = hostile
    reference = [p.clone() for p in parts]
    flat = FlatRows(parts)
    bound = bounds.group_norms([flat.bounds()])
    for value, norm in zip(bound.tolist(), _exact_norms(reference), strict=True):
        assert value >= norm or not math.isfinite(value)  # a finite bound is an upper bound
    drop = (bound < math.inf).logical_not_()
    others = [i for i in range(6) if i != 2]
    assert not drop[others].any()
    # a non-finite value is dropped; 3e38 may keep a finite bound (above its norm, checked)
    assert bool(drop[2]) == (hostile is not None and not math.isfinite(hostile)) or hostile == 3e38
    coef = torch.rand(6, generator=torch.Generator().manual_seed(seed)).masked_fill_(drop, 0)
    outs = [torch.full(p.shape[1:], 0.5) for p in parts]
    flat.add_to(outs, coef, drop)
    for out, x in zip(outs, reference, strict=True):
        kept = x.masked_fill(drop.view(-1, *[1] * (x.dim() - 1)), 0).double()
        expected = 0.5 + torch.tensordot(coef.double(), kept, dims=1)
        scale = 0.5 + torch.tensordot(coef.double(), kept.abs(), dims=1)  # float32 sums: 1e-6
        assert ((out.double() - expected).abs() <= 1e-5 * scale).all()
    if count == 1:  # a single tensor is zeroed out of place: the caller's rows are left alone
        torch.testing.assert_close(parts[0], reference[0], equal_nan=True)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("groups", "channels", "spatial"), [(1, 4, (5, 5)), (2, 6, (3,)), (3, 6, ()), (4, 4, (2, 3, 2))]
)
def test_group_norm_per_sample_gradients_in_one_operation(
    groups: int, channels: int, spatial: tuple[int, ...]
) -> None:
    """Per-sample ∂L/∂w and ∂L/∂b of a GroupNorm equal torch.func's; the forward's mean and 1/σ
    are reused (the clipper's step normalises no input a second time) and recomputed alike."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(groups, channels)
    nn.init.normal_(norm.weight)
    x = torch.randn(5, channels, *spatial, requires_grad=True)
    output = norm(x)
    g = torch.randn_like(output)
    rule = RULES[nn.GroupNorm]
    saved = rule.saved(x, output)
    assert saved is not None
    with _Ops() as ops:
        reused = rule.small(norm, [Call(x.detach(), g, saved)])
    assert "native_group_norm" not in ops.names
    recomputed = rule.small(norm, [Call(x.detach(), g)])
    per_sample = torch.func.vmap(
        lambda xi, gi: torch.func.grad(
            lambda p: (torch.func.functional_call(norm, p, (xi[None],))[0] * gi).sum()
        )(dict(norm.named_parameters()))
    )(x.detach(), g)
    for name in ("weight", "bias"):
        torch.testing.assert_close(reused[name], per_sample[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(recomputed[name], reused[name])


class _Positions(nn.Module):
    """A position embedding with at most as many ids as positions (its per-sample gradients
    are kept), a padding id, ids repeated within a sample, then a LayerNorm and a GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Embedding(6, 4, padding_idx=2)
        self.norm = nn.LayerNorm(4)
        self.group = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.norm(self.position(ids))  # [B, T, 4]
        return self.head(self.group(h.transpose(1, 2)).mean(-1))


@pytest.mark.parametrize("flat", [False, True], ids=["cpu_alone", "flat_as_on_cuda"])
@pytest.mark.parametrize("style", ["all_layer", "layer_wise", "param_wise"])
def test_kept_embedding_and_group_norm_clip_as_the_exact_per_sample_gradients(
    style: str, flat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor alone, as on CPU, and in the group's flat buffer, as on an accelerator
    (``clipper.flat_limit``)."""
    if flat:
        monkeypatch.setattr(clipper, "flat_limit", lambda device: clipper.FLAT_ELEMENTS)
    buffers: list[int] = []  # the tensors each flat buffer holds

    def flat_rows(parts: list[Tensor]) -> FlatRows:
        buffers.append(len(parts))
        return FlatRows(parts)

    monkeypatch.setattr(clipper, "FlatRows", flat_rows)
    torch.manual_seed(0)
    model = _Positions()
    ids = torch.randint(0, 6, (7, 9))
    y = torch.randint(0, 3, (7,))
    names = [n for n, _ in model.named_parameters()]
    groups = (
        [names]
        if style == "all_layer"
        else [[n] for n in names]
        if style == "param_wise"
        else [[n for n in names if n.startswith(m)] for m in ("position", "norm", "group", "head")]
    )
    threshold = 0.05
    norms, sums = clipped_grad_sum(
        model, LOSS, ids, y, groups, lambda n: (threshold / n).clamp(max=1.0)
    )
    grads = per_sample_grads(model, LOSS, ids, y)
    exact = torch.stack(
        [torch.cat([grads[n].flatten(1) for n in group], 1).norm(dim=1) for group in groups], 1
    )
    assert (norms >= exact).all()
    torch.testing.assert_close(norms, exact, rtol=1e-3, atol=1e-6)
    coef = (threshold / norms).clamp(max=1.0)
    for m, group in enumerate(groups):
        for name in group:
            expected = torch.tensordot(coef[:, m], grads[name], dims=1)
            torch.testing.assert_close(sums[name], expected, rtol=1e-4, atol=1e-6)
    assert max(buffers) > 1 if flat and style != "param_wise" else max(buffers) == 1
