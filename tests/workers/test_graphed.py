"""Padded micro-batches and CUDA-graph replays compute what the plain clipper computes
(``workers.dp.graphed``): padding rows contribute exactly nothing, hostile rows stay as harmless
as on the plain path, and a replayed step equals an eager one. The CUDA tests run wherever a
GPU is (``bench/device/run.sh``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from core.config import ModelConfig
from workers.dp import ghost
from workers.dp import grads as general
from workers.dp.adaptive import DecayRule, ThresholdRule
from workers.dp.clipping import coefficient_fn, resolve_groups
from workers.dp.engine import PrivateStep
from workers.dp.graphed import WARM_UP, Padded
from workers.dp.optim import SGD
from workers.dp.randomness import SecureStream
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
CLIPPERS = {"general": general.clipped_grad_sum, "fast": ghost.clipped_grad_sum}
MODELS = {  # name: (options, input shape)
    "logreg": ({}, (2, 3, 3)),
    "cnn": ({}, (1, 8, 8)),
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (3, 5)),
    "resnet18": ({"width": 4, "norm_groups": 2}, (3, 8, 8)),
}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str, device: str = "cpu") -> nn.Module:
    options, shape = MODELS[name]
    torch.manual_seed(0)
    return build_model(ModelConfig(name=name, options=options), shape, 3).to(device)


def _batch(name: str, n: int, hostile: bool) -> tuple[Tensor, Tensor]:
    """``n`` examples; with ``hostile``, one holds a NaN, one an infinity, one ±1e20."""
    _, shape = MODELS[name]
    g = torch.Generator().manual_seed(n)
    if name == "transformer":
        x = torch.randint(0, 5, (n, *shape), generator=g).float()
    else:
        x = torch.randn(n, *shape, generator=g)
    if hostile and name != "transformer":
        for row, value in zip(range(0, n, 3), (math.nan, math.inf, 1e20), strict=False):
            x[row].view(-1)[1] = value
    return x, torch.arange(n) % 3


def _close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("clipper", list(CLIPPERS))
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("style", ["all_layer", "layer_wise"])
@pytest.mark.parametrize(("n", "size"), [(1, 1), (1, 8), (5, 8), (7, 7), (6, 13)])
def test_padding_adds_nothing(clipper, name, style, n, size) -> None:
    """For every model, clipper, style and micro-batch size n ≤ P: the padded call's norms
    are the plain call's and its sums are the plain call's, hostile rows included."""
    model = _model(name)
    groups = resolve_groups(model, style)
    coef_fn = coefficient_fn("abadi", 1.0, len(groups))
    x, y = _batch(name, n, hostile=True)
    plain_norms, plain_sums = CLIPPERS[clipper](model, LOSS, x, y, groups, coef_fn)
    padded = Padded(CLIPPERS[clipper], size, graph=False)
    for _ in range(2):  # the second call pads with what the first left
        norms, sums = padded(model, LOSS, x, y, groups, coef_fn)
        assert norms.shape == plain_norms.shape
        _close(norms, plain_norms)
        for key, value in plain_sums.items():
            assert sums[key].isfinite().all()
            _close(sums[key], value)


def test_a_padded_call_refuses_more_rows_than_its_size() -> None:
    model = _model("logreg")
    groups = resolve_groups(model, "all_layer")
    x, y = _batch("logreg", 5, hostile=False)
    with pytest.raises(ValueError, match="exceeds the padded size 4"):
        Padded(ghost.clipped_grad_sum, 4, graph=False)(
            model, LOSS, x, y, groups, coefficient_fn("abadi", 1.0, 1)
        )


class _Zero(SecureStream):
    """No noise: the steps compared differ only in how the clipped sums are formed."""

    def normal(self, shape, *, device="cpu", dtype=torch.float32, out=None, scale=1.0):
        out = torch.empty(shape, device=device, dtype=dtype) if out is None else out
        return out.zero_()


def _engine(model: nn.Module, padded_rows: int | None, rule: ThresholdRule) -> PrivateStep:
    return PrivateStep(
        model,
        LOSS,
        resolve_groups(model, "all_layer"),
        ghost.clipped_grad_sum,
        clipping="abadi",
        gamma=0.01,
        rule=rule,
        grad_noise=1.0,
        expected_batch_size=8,
        optimizer=SGD(model.parameters(), lr=0.1),
        noise=_Zero(),
        padded_rows=padded_rows,
    )


def _rule(name: str) -> ThresholdRule:
    """A fixed threshold, or one that changes every step (Du et al.'s decay)."""
    return ThresholdRule(0.5) if name == "fixed" else DecayRule(2.0, decay=0.01, total_steps=8)


def _steps(
    name: str, device: str, padded_rows: int | None, sizes: list[int], rule: str = "fixed"
) -> nn.Module:
    model = _model(name, device)
    engine = _engine(model, padded_rows, _rule(rule))
    for t, n in enumerate(sizes):
        x, y = _batch(name, n, hostile=t % 2 == 1)
        engine.step([(x.to(device), y.to(device))], t)
    return model


def _same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (key, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.isfinite().all(), key
        _close(p.detach().cpu(), q.detach().cpu())


SIZES = [8, 3, 0, 8, 5, 1, 7, 2]  # more steps than the warm-up, empty and hostile batches


@pytest.mark.parametrize("rule", ["fixed", "decay"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_padded_engine_steps_equal_plain_ones_on_cpu(name, rule) -> None:
    """Padded, the clip factors read C_t from the device (written each step): the same steps
    as with C_t a number, whether it stays or changes every step."""
    padded, plain = _steps(name, "cpu", 8, SIZES, rule), _steps(name, "cpu", None, SIZES, rule)
    _same_parameters(padded, plain)


def test_on_cpu_micro_batches_are_padded_and_never_replayed() -> None:
    model = _model("logreg")
    assert not _engine(model, 8, ThresholdRule(1.0)).graphed
    assert isinstance(_engine(model, 8, ThresholdRule(1.0)).clipper, Padded)
    assert _engine(model, None, ThresholdRule(1.0)).clipper is ghost.clipped_grad_sum


@cuda
@pytest.mark.parametrize("rule", ["fixed", "decay"])
@pytest.mark.parametrize("name", list(MODELS))
def test_replayed_steps_equal_eager_ones_on_a_gpu(name, rule) -> None:
    """More steps than the warm-up, so that later ones replay the recorded call; empty and
    hostile batches among them; a threshold that changes every step is read at each replay."""
    replayed = _steps(name, "cuda", 8, SIZES, rule)
    _same_parameters(replayed, _steps(name, "cuda", None, SIZES, rule))


@cuda
def test_a_fixed_threshold_on_a_gpu_is_replayed() -> None:
    model = _model("cnn", "cuda")
    engine = _engine(model, 8, ThresholdRule(1.0))
    assert engine.graphed
    for t in range(WARM_UP + 2):
        x, y = _batch("cnn", 6, hostile=False)
        engine.step([(x.cuda(), y.cuda())], t)
    assert isinstance(engine.clipper, Padded) and engine.clipper.recorded is not None
    assert all(p.isfinite().all() for p in model.parameters())


@cuda
def test_an_adaptive_threshold_on_a_gpu_is_replayed() -> None:
    rule = DecayRule(1.0, decay=0.5, total_steps=10)
    assert _engine(_model("cnn", "cuda"), 8, rule).graphed


@pytest.mark.parametrize(
    ("batch", "physical", "rows"), [(64, 256, 96), (256, 256, 256), (8, 256, 24)]
)
def test_a_gpu_trial_pads_to_four_deviations_above_its_batch(batch, physical, rows) -> None:
    """B + 4√B in multiples of 8, at most the physical batch size; on CPU, and for a model of
    the analyst's own, nothing is padded."""
    from types import SimpleNamespace

    from workers.trial import replayed_rows

    def cfg(factory: str | None) -> Any:
        model = SimpleNamespace(factory=factory)
        return SimpleNamespace(model=model, batch_size=batch, physical_batch_size=physical)

    assert replayed_rows(cfg(None), torch.device("cuda")) == rows
    assert replayed_rows(cfg(None), torch.device("cpu")) is None
    assert replayed_rows(cfg("a.b:c"), torch.device("cuda")) is None
