"""Book-kept inputs zeroed and summed a slice of examples at a time (``MASK_CHUNK_BYTES``) give
the clipped sums and norms of the whole batch at once, hostile record or not: a clipped sum is
a sum over examples, and a dropped example contributes exactly zero in every slice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.config import ModelConfig
from workers.dp import ghost
from workers.dp.clipping import coefficient_fn, resolve_groups
from workers.dp.ghost import clipper
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
MODELS = {  # name: (options, input shape)
    "logreg": ({}, (2, 3, 3)),
    "mlp": ({"hidden": 8}, (2, 3, 3)),
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (5, 3)),
    "resnet18": ({"width": 4, "norm_groups": 2}, (3, 8, 8)),
}


def _run(name: str, style: str, hostile: float | None) -> tuple[torch.Tensor, dict]:
    options, shape = MODELS[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, options=options), shape, 3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, *shape, generator=g)
    if hostile is not None:
        x[2].view(-1)[0] = hostile
    y = torch.randint(0, 3, (7,), generator=g)
    groups = resolve_groups(model, style)
    coef = coefficient_fn("abadi", 0.5, len(groups), scale=2.0)
    norms, sums = ghost.clipped_grad_sum(model, LOSS, x, y, groups, coef)
    return norms, {k: v.clone() for k, v in sums.items()}


@pytest.mark.parametrize("hostile", [None, float("nan"), float("inf"), 3e38])
@pytest.mark.parametrize("style", ["all_layer", "layer_wise"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_slices_of_examples_sum_to_the_whole_batch(
    name: str, style: str, hostile: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_norms, whole = _run(name, style, hostile)
    monkeypatch.setattr(clipper, "MASK_CHUNK_BYTES", 1)  # one example a slice
    norms, sliced = _run(name, style, hostile)
    torch.testing.assert_close(norms, whole_norms, equal_nan=True)
    for key, total in whole.items():
        assert torch.isfinite(sliced[key]).all(), key
        torch.testing.assert_close(sliced[key], total, rtol=1e-5, atol=1e-6)
