"""The clippers compute as a GPU step must (issue 43): no float64 tensor, and no host
synchronisation (``.item()``, ``bool(tensor)``, a branch on a tensor's value), with or without a
hostile record in the batch, for every built-in model, clipping style and clipping function.

A ``TorchDispatchMode`` watches one ``clipped_grad_sum`` call after a warm-up call (the fast
clipper times its ways of forming convolution gradients on first use): every operation's
outputs must be float32 (or integer/bool), and ``aten._local_scalar_dense`` (what ``.item()``,
``float()`` and ``bool()`` of a tensor dispatch) must not run, nor any operation whose output
shape depends on the data (``nonzero``, ``unique``, ``masked_select``: a sync on a GPU)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from core.config import ModelConfig
from workers.dp import ghost
from workers.dp import grads as general
from workers.dp.clipping import coefficient_fn, resolve_groups
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
SYNCS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select", "item"}
MODELS = {  # name: (options, input shape)
    "logreg": ({}, (2, 3, 3)),
    "mlp": ({"hidden": 8}, (2, 3, 3)),
    "cnn": ({}, (1, 8, 8)),
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (5, 3)),
    "lstm": ({"hidden": 5}, (3, 6)),
    "resnet18": ({"width": 4, "norm_groups": 2}, (3, 8, 8)),
}
CLIPPERS = {"fast": ghost.clipped_grad_sum, "general": general.clipped_grad_sum}


class Watch(TorchDispatchMode):
    """Records host syncs and float64 outputs, by operation."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.float64: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNCS:
            self.syncs.append(name)
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple | list) else (out,)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in outs):
            self.float64.append(name)
        return out


def _batch(shape: tuple[int, ...], hostile: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, *shape, generator=g)
    if hostile is not None:
        x[1].view(-1)[0] = {"nan": math.nan, "inf": math.inf, "huge": 3e38}[hostile]
    return x, torch.arange(4) % 3


@pytest.mark.parametrize("hostile", [None, "nan", "inf", "huge"])
@pytest.mark.parametrize(  # every style and every function, each style with another function
    ("style", "function"),
    [("all_layer", "abadi"), ("layer_wise", "auto_s"), ("param_wise", "auto_v")],
)
@pytest.mark.parametrize("clipper", CLIPPERS)
@pytest.mark.parametrize("name", MODELS)
def test_a_clipper_call_makes_no_float64_and_no_host_sync(
    name: str, clipper: str, function: str, style: str, hostile: str | None
) -> None:
    if clipper == "general" and (name in ("resnet18", "lstm") or style == "layer_wise"):
        pytest.skip("the general path treats every model alike: a few cases suffice")
    options, shape = MODELS[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, options=options), shape, 3)
    groups = resolve_groups(model, style)
    coef_fn = coefficient_fn(function, 1.0, len(groups))
    x, y = _batch(shape, hostile)
    CLIPPERS[clipper](model, LOSS, x, y, groups, coef_fn)  # warm-up
    with Watch() as watch:
        norms, sums = CLIPPERS[clipper](model, LOSS, x, y, groups, coef_fn)
    assert watch.syncs == [], watch.syncs
    assert watch.float64 == [], watch.float64
    assert norms.dtype == torch.float32
    assert all(s.isfinite().all() for s in sums.values())
