"""Crafted examples whose per-sample gradient cancels across positions (issue 17, item 8).

A layer applied at T = 2 positions with output gradients ``+w`` and ``-w`` and inputs
``a_1 = M·v``, ``a_2 = M·v + δ`` (M up to 1e4, ``‖w‖`` ~ 1e3) has the per-sample weight
gradient ``-w δᵀ``, tiny next to the terms it comes from. In float32 the ghost norm
``Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (or an instantiated ``Σ_t g_t a_tᵀ``) of such an example is
rounding noise, while the clipped sum is formed by another route; an example whose norm comes
out too small then contributes more than its bound. Each candidate's contribution is measured
as the norm of the clipped sum of a batch holding it alone; none may exceed R.

The ``linear_ulp`` candidates differ between positions by a few float32 ulps over 256
features: even a float64 ghost norm of those is off by more than the gradient itself, so they
pass only thanks to the rounding guard of ``workers.dp.ghost.layers.positions_sq_norms``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from workers.dp import ghost
from workers.dp import grads as general
from workers.dp.clipping import coefficient_fn
from workers.dp.ghost import layers as ghost_layers

R = 1.0
CANDIDATES = 128
CLIPPERS = {"general": general.clipped_grad_sum, "fast": ghost.clipped_grad_sum}


pytestmark = pytest.mark.usefixtures("one_thread")


def output_gradient_loss(out: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss whose gradient with respect to the model's output is ``target``."""
    return (out * target).flatten(1).sum(1)


def _log_uniform(g: torch.Generator, n: int, low: float, high: float) -> Tensor:
    return 2.0 ** torch.empty(n, 1).uniform_(low, high, generator=g)


def _cancelling_rows(n: int, d: int, g: torch.Generator) -> Tensor:
    """[n, 2, d]: rows M·v and M·v + δ with ‖δ‖ about 2^-12 of ‖M·v‖."""
    scale = 10.0 ** torch.empty(n, 1).uniform_(2, 4, generator=g)
    v = scale * torch.randn(n, d, generator=g)
    delta = torch.randn(n, d, generator=g) * scale * _log_uniform(g, n, -14, -10)
    return torch.stack([v, v + delta], 1)


def _opposite(n: int, p: int, g: torch.Generator) -> Tensor:
    """[n, 2, p]: output gradients +w and -w."""
    w = 1e3 * torch.randn(n, p, generator=g)
    return torch.stack([w, -w], 1)


def linear(d: int, p: int) -> tuple[nn.Module, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return nn.Linear(d, p), _cancelling_rows(CANDIDATES, d, g), _opposite(CANDIDATES, p, g)


def conv1d() -> tuple[nn.Module, Tensor, Tensor]:
    """A 1-wide convolution over two positions: channels first."""
    _, x, target = linear(4, 4)
    return nn.Conv1d(4, 4, 1), x.mT.contiguous(), target.mT.contiguous()


def linear_ulp(d: int = 256) -> tuple[nn.Module, Tensor, Tensor]:
    """Rows in [2^20, 2^21) and the same rows moved by -3..3 ulps (2^-23 relative each)."""
    g = torch.Generator().manual_seed(0)
    n = CANDIDATES // 4
    base = 2.0**20 * (1 + torch.rand(n, d, generator=g))
    ulp = torch.nextafter(base, torch.full_like(base, math.inf)) - base
    moved = base + torch.randint(-3, 4, (n, d), generator=g) * ulp
    return nn.Linear(d, d), torch.stack([base, moved], 1), _opposite(n, d, g)


def conv1d_ulp() -> tuple[nn.Module, Tensor, Tensor]:
    """``linear_ulp``'s rows as a 1-wide convolution over two positions."""
    _, x, target = linear_ulp()
    return nn.Conv1d(256, 256, 1), x.mT.contiguous(), target.mT.contiguous()


class Twin(nn.Module):
    """Two 1-wide convolutions of one geometry on the same input, their outputs added: both get
    the same cancelling gradient, and the clipper measures and sums them as the two maps of one
    grouped convolution (``workers.dp.ghost.clipper._Stack``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(channels, channels, 1), nn.Conv1d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.b(x)


def conv1d_twin() -> tuple[nn.Module, Tensor, Tensor]:
    _, x, target = conv1d()
    return Twin(4), x, target


def conv1d_ulp_twin() -> tuple[nn.Module, Tensor, Tensor]:
    _, x, target = conv1d_ulp()
    return Twin(256), x, target


def embedding() -> tuple[nn.Module, Tensor, Tensor]:
    """One id at both positions, output gradients w and -w + η: the row's gradient is η."""
    g = torch.Generator().manual_seed(0)
    w = 1e3 * torch.randn(CANDIDATES, 4, generator=g)
    eta = torch.randn(CANDIDATES, 4, generator=g) * 1e3 * _log_uniform(g, CANDIDATES, -14, -10)
    ids = torch.ones(CANDIDATES, 2, dtype=torch.long)
    return nn.Embedding(3, 4), ids, torch.stack([w, -w + eta], 1)


LAYERS = {
    "linear_ghost": lambda: linear(4, 4),  # T(d + p) = 16 <= p·d: ghost norm
    # T(d + p) = 8 > p·d: instantiated; book-kept, as no book-kept layer lies below it
    "linear_instantiated": lambda: linear(2, 2),
    "conv1d_ghost": conv1d,  # patches of one position: the same ghost norm
    "linear_ulp": linear_ulp,
    "conv1d_ulp": conv1d_ulp,
    "conv1d_twin": conv1d_twin,
    "conv1d_ulp_twin": conv1d_ulp_twin,
    "embedding": embedding,
}


@pytest.mark.parametrize("function", ["abadi", "auto_s", "auto_v"])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("clipper", CLIPPERS)
def test_no_example_contributes_more_than_its_bound(
    clipper: str, layer: str, function: str
) -> None:
    assert_bounded(clipper, *LAYERS[layer](), function)


@pytest.mark.parametrize("function", ["abadi", "auto_v"])
@pytest.mark.parametrize("layer", ["conv1d_ghost", "conv1d_ulp", "conv1d_ulp_twin"])
def test_conv_norms_from_pixels_keep_the_bound(
    monkeypatch: pytest.MonkeyPatch, layer: str, function: str
) -> None:
    """The convolution's ghost norm with its patches' Gram matrices formed from the pixels'
    (``ConvRule._pixel_norms``), forced; without the rounding guard a ``conv1d_ulp``
    candidate contributes 1.18·R."""
    monkeypatch.setattr(ghost_layers.ConvRule, "_from_pixels", lambda *_: True)
    assert_bounded("fast", *LAYERS[layer](), function)


def assert_bounded(clipper: str, model: nn.Module, x: Tensor, target: Tensor, function: str):
    """No candidate (row of ``x`` and ``target``), clipped alone, contributes more than R."""
    torch.manual_seed(0)
    groups = [[n for n, _ in model.named_parameters()]]
    coef_fn = coefficient_fn(function, R, len(groups))
    worst, worst_i = 0.0, -1
    for i in range(len(x)):
        _, sums = CLIPPERS[clipper](
            model, output_gradient_loss, x[i : i + 1], target[i : i + 1], groups, coef_fn
        )
        got = math.sqrt(sum(float(s.double().square().sum()) for s in sums.values()))
        if got > worst:
            worst, worst_i = got, i
    assert worst <= R * (1 + 1e-6), f"candidate {worst_i} contributes {worst:.4g} > R = {R}"


def test_embedding_norms_keep_the_guard_where_float32_rows_lose_terms() -> None:
    """Three positions of one id with output gradients M, η, −M (M = 2⁴⁰, η = 2¹⁰): float32
    adds M + η to M, so the row comes out 0 though the gradient is η; what a sum formed in
    another order would add is bounded only through the guard κ·S², S = Σ_t ‖g_t‖ ≥ 2M."""
    from workers.dp.bounds import gamma
    from workers.dp.ghost.layers import RULES, Call

    module = nn.Embedding(3, 1)
    g = torch.tensor([[[2.0**40], [2.0**10], [-(2.0**40)]]])
    bound = RULES[nn.Embedding].weight_norms(module, [Call(torch.ones(1, 3).long(), g)])
    (norm,) = bound.scale * bound.value + bound.floor
    # the exact norm η plus what the clipped sum of three rows may add by rounding (γ₄·S)
    assert norm >= 2.0**10 + gamma(4) * 2 * 2.0**40
