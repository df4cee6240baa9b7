"""Invariant 9 (docs/design.md): hostile records are harmless on both clippers.

A record with a NaN or an infinite feature contributes exactly zero to every clipping group
where its norm is not finite (those norms stay non-finite, so callers can see it) and at most
R_m to any other group; a record with huge finite features (1e20 in float32, whose squared norm
overflows float32) gets an infinite norm bound wherever its gradient's squares overflow
(``workers.dp.bounds`` does not rescale) and then contributes exactly zero there, at most its
clipping bound elsewhere; a record with subnormal features (1e-40), whose AUTO-V factor R/‖g‖
would exceed the float32 range, gets a finite norm and contributes at most its clipping bound (a
GroupNorm and LayerNorm can blow up its gradients likewise); the other examples' norms do not
change. Checked for the general
(``torch.func``) and the fast (ghost / book-keeping) clipper, every clipping style and every
clipping function, on built-in models that cover rank-one Linear layers, convolutions (ghost
and per-sample gradients kept in the backward), sequences with an embedding and LayerNorm,
a Linear shared across time steps, GroupNorm, and the fast path's ``torch.func`` fallback.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from core.config import ModelConfig
from workers.dp import ghost
from workers.dp import grads as general
from workers.dp.clipping import coefficient_fn, resolve_groups
from workers.dp.ghost import layers as ghost_layers
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
R = 1.0
SLACK = 1 + 1e-6
CLIPPERS = {"general": general.clipped_grad_sum, "fast": ghost.clipped_grad_sum}
FUNCTIONS = ["abadi", "auto_s", "auto_v"]
STYLES = ["all_layer", "layer_wise", "param_wise", "groups"]
MODELS = {  # name: (options, input shape)
    "logreg": ({}, (2, 3, 3)),  # rank-one Linear
    "cnn": ({}, (1, 8, 8)),  # Conv2d (ghost norm, per-sample gradients kept) and Linear
    # sequence Linear layers, an Embedding, LayerNorm
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (3, 5)),
    "lstm": ({"hidden": 5}, (3, 6)),  # a Linear called once per time step
    # GroupNorm, kept conv gradients, stacked book-kept convolutions
    "resnet18": ({"width": 4, "norm_groups": 2}, (3, 8, 8)),
}
# The fast path with LayerNorm taken off its rules: LayerNorm parameters use torch.func.
FALLBACK = "transformer"
# The general path treats every model alike (vmap over the batch): two models are enough,
# which keeps this file well under a minute on two cores.
GENERAL_MODELS = {"logreg", "transformer"}
# resnet18 is the heavy case: three styles of it (the other models cover all four); all-layer
# clipping stacks its later stages' same-shaped convolutions (``workers.dp.ghost.clipper``).
STYLES_OF = {"resnet18": ["all_layer", "layer_wise", "groups"]}
CLEAN, HOSTILE = [0, 2, 6, 7], {"nan": 1, "inf": 3, "huge": 4, "tiny": 5}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str) -> nn.Module:
    options, shape = MODELS[name]
    torch.manual_seed(0)
    return build_model(ModelConfig(name=name, options=options), shape, 3)


@functools.cache
def _batch(name: str) -> tuple[Tensor, Tensor]:
    """Eight examples: four ordinary ones and, at ``HOSTILE``'s positions, one with a NaN
    feature, one with an infinite feature, one whose every feature is ±1e20, labelled with a
    class its logits rank below the top (so that its gradient is not zero), and one whose every
    feature is ±1e-40 (subnormal in float32)."""
    _, shape = MODELS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(CLEAN) + len(HOSTILE), *shape, generator=g)
    x[HOSTILE["nan"]].view(-1)[3] = math.nan
    x[HOSTILE["inf"]].view(-1)[5] = math.inf
    x[HOSTILE["huge"]] = 1e20 * torch.randn(shape, generator=g).sign()
    x[HOSTILE["tiny"]] = 1e-40 * torch.randn(shape, generator=g).sign()
    y = torch.arange(len(x)) % 3
    with torch.no_grad():
        logits = _model(name)(x[HOSTILE["huge"]][None])[0]
    if logits.isfinite().all():
        y[HOSTILE["huge"]] = (logits.argmax() + 1) % 3
    return x, y


def _groups(model: nn.Module, style: str) -> list[list[str]]:
    if style != "groups":
        return resolve_groups(model, style)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return resolve_groups(model, [names[::2], names[1::2]])


def _norm(sums: dict[str, Tensor], names: list[str]) -> float:
    return math.sqrt(sum(float(sums[n].double().square().sum()) for n in names))


Clipper = Callable[..., tuple[Tensor, dict[str, Tensor]]]
Run = Callable[[list[int]], tuple[Tensor, dict[str, Tensor]]]


def _setup(clipper: Clipper, name: str, style: str, function: str) -> tuple[Run, list[list[str]]]:
    """The clipper on a subset of ``_batch(name)``'s rows, and the clipping groups."""
    model = _model(name)
    x, y = _batch(name)
    groups = _groups(model, style)
    coef_fn = coefficient_fn(function, R, len(groups))

    def run(rows: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
        return clipper(model, LOSS, x[rows], y[rows], groups, coef_fn)

    return run, groups


def _nan_and_inf_contribute_zero(run: Run, groups: list[list[str]], name: str) -> None:
    """Each alone adds exactly zero to every group where its norm is not finite (an infinite
    feature can leave some groups finite: tanh(∞) = 1), and at most R_m to any other."""
    for what in ("nan", "inf"):
        norms, sums = run([HOSTILE[what]])
        assert not norms.isfinite().all(), f"{what}: norms {norms.tolist()} should not be finite"
        for m, group in enumerate(groups):
            for key in group:
                assert sums[key].isfinite().all(), f"{what}, {key}: non-finite sum"
                if not norms[0, m].isfinite():
                    assert not sums[key].any(), f"{what}, {key}: non-finite group adds {sums[key]}"
        _within_bound(sums, groups, f"{what} example")


def _within_bound(sums: dict[str, Tensor], groups: list[list[str]], what: str) -> None:
    r_m = R / math.sqrt(len(groups))
    for m, group in enumerate(groups):
        got = _norm(sums, group)
        assert got <= r_m * SLACK, f"{what}: group {m} contribution {got} > {r_m}"
    assert _norm(sums, list(sums)) <= R * SLACK


def _adds_nothing_where_unbounded(
    norms: Tensor, sums: dict[str, Tensor], groups: list[list[str]], what: str
) -> None:
    """A group whose norm bound is not finite (the gradient's squares overflow float32) gets
    nothing from the example; a bound is never zero (its floors)."""
    assert not (norms == 0).any(), f"{what}: norms {norms}"
    for m, group in enumerate(groups):
        if not norms[0, m].isfinite():
            assert not any(sums[key].any() for key in group), f"{what} adds to group {m}"
    _within_bound(sums, groups, what)


def _huge_is_clipped(run: Run, groups: list[list[str]], name: str) -> None:
    norms, sums = run([HOSTILE["huge"]])
    _adds_nothing_where_unbounded(norms, sums, groups, "1e20 example")


def _tiny_is_clipped(run: Run, groups: list[list[str]], name: str) -> None:
    """Finite norms on the models without normalisation layers; a GroupNorm or LayerNorm scales
    the tiny input up by 1/√ε and its output gradients by more (resnet18's GroupNorm biases get
    gradients of 1e19 and up), where the bound may overflow and the group gets nothing."""
    norms, sums = run([HOSTILE["tiny"]])
    if name in ("logreg", "cnn", "lstm"):
        assert norms.isfinite().all(), f"1e-40 example: norms {norms}"
    _adds_nothing_where_unbounded(norms, sums, groups, "1e-40 example")


def _mixed_batch_is_finite(run: Run, groups: list[list[str]], name: str) -> None:
    """In one batch with ordinary examples: finite sums, the others' norms unchanged, and the
    sum of what each part adds alone."""
    norms, sums = run(list(range(len(CLEAN) + len(HOSTILE))))
    for key, value in sums.items():
        assert value.isfinite().all(), f"{key}: non-finite sum"
    clean_norms, clean_sums = run(CLEAN)
    torch.testing.assert_close(norms[CLEAN].double(), clean_norms.double(), rtol=1e-6, atol=0)
    parts = [clean_sums] + [run([HOSTILE[what]])[1] for what in ("huge", "tiny", "nan", "inf")]
    for key, value in sums.items():
        expected = sum(part[key] for part in parts)
        scale = expected.abs().max().clamp_min(1e-12)
        err = float((value - expected).abs().max() / scale)
        assert err <= 1e-5, f"{key}: sum differs from the sum of its parts by {err:.1e}"


CASES = [
    pytest.param(clipper, name, style, function, id=f"{clipper}-{name}-{style}-{function}")
    for clipper in CLIPPERS
    for name in MODELS
    for style in STYLES_OF.get(name, STYLES)
    for function in FUNCTIONS
    if clipper == "fast" or name in GENERAL_MODELS
]


CHECKS: dict[str, Callable[[Run, list[list[str]], str], None]] = {
    "nan_inf_zero": _nan_and_inf_contribute_zero,
    "huge_clipped": _huge_is_clipped,
    "tiny_clipped": _tiny_is_clipped,
    "mixed_batch": _mixed_batch_is_finite,
}


def _check(clipper: Clipper, name: str, style: str, function: str, check: str) -> None:
    run, groups = _setup(clipper, name, style, function)
    CHECKS[check](run, groups, name)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize(("clipper", "name", "style", "function"), CASES)
def test_hostile_records(clipper: str, name: str, style: str, function: str, check: str) -> None:
    _check(CLIPPERS[clipper], name, style, function, check)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_hostile_records_on_the_fast_paths_torch_func_fallback(
    monkeypatch: pytest.MonkeyPatch, style: str, function: str, check: str
) -> None:
    monkeypatch.delitem(ghost_layers.RULES, nn.LayerNorm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(ghost.clipped_grad_sum, FALLBACK, style, function, check)
    assert any(
        w.category is ghost.FallbackWarning and "LayerNorm" in str(w.message) for w in caught
    )


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("way", ["_grouped_per_sample", "_matmul_per_sample"])
def test_hostile_records_on_each_way_of_forming_kept_convolution_gradients(
    monkeypatch: pytest.MonkeyPatch, way: str, function: str, check: str
) -> None:
    """Each way ``ConvRule.weight_per_sample`` may pick for a geometry (``_Faster``), forced
    on the cnn's convolutions, whose per-sample gradients are kept."""
    forced, ran = getattr(ghost_layers, way), []

    def spy(*args):
        ran.append(len(args[0]))
        return forced(*args)

    monkeypatch.setattr(ghost_layers, "_FASTER", {})
    monkeypatch.setattr(ghost_layers, "_Faster", lambda candidates: spy)
    _check(ghost.clipped_grad_sum, "cnn", "layer_wise", function, check)
    assert ran
