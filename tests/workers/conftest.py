"""Fixtures of the worker tests (tests run with --import-mode=importlib, so helpers are handed
out as fixtures)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch import nn

from workers.dp import PrivateStep, clipped_grad_sum, resolve_groups
from workers.dp.adaptive import ThresholdRule
from workers.dp.optim import SGD
from workers.dp.randomness import SecureStream

LOSS = nn.CrossEntropyLoss(reduction="none")


def _make_step(
    model,
    *,
    noise,
    threshold,
    expected,
    stream=None,
    style="layer_wise",
    clipper=clipped_grad_sum,
    rule=None,
    lr=0.0,
    clipping="abadi",
    draw_ahead=False,
    padded_rows=None,
) -> PrivateStep:
    return PrivateStep(
        model,
        LOSS,
        resolve_groups(model, style),
        clipper,
        clipping=clipping,
        gamma=0.01,
        rule=rule or ThresholdRule(threshold),
        grad_noise=noise,
        expected_batch_size=expected,
        optimizer=SGD(model.parameters(), lr=lr),
        noise=stream or SecureStream(),
        draw_ahead=draw_ahead,
        padded_rows=padded_rows,
    )


@pytest.fixture
def make_step() -> Callable[..., PrivateStep]:
    """``make_step(model, noise=σ, threshold=C, expected=B, ...)``: the engine's step with Abadi
    clipping, the product's SGD, and a fresh secure stream unless ``stream`` is given."""
    return _make_step
