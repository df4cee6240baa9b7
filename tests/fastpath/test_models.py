"""The fast clipper on every built-in model (``workers.models``) against the general path.

Small widths keep this fast; the transformer runs with batch size = sequence length, the case
where a layer fed [T, ...] cannot be told apart from a per-sample one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from workers.dp.clipping import coefficient_fn
from workers.dp.ghost import FallbackWarning, clipped_grad_sum

models = pytest.importorskip("workers.models")
grads = pytest.importorskip("workers.dp.grads")
config = pytest.importorskip("core.config")

LOSS = nn.CrossEntropyLoss(reduction="none")
CASES = {  # name: (options, input shape, batch)
    "logreg": ({}, (2, 3, 3), 6),
    "mlp": ({"hidden": 8}, (10,), 6),
    "cnn": ({}, (1, 8, 8), 6),
    "resnet18": ({"width": 4, "norm_groups": 2}, (3, 8, 8), 4),
    "lstm": ({"hidden": 5}, (3, 6), 6),
    "transformer": ({"dim": 8, "heads": 2, "layers": 1, "ff": 16}, (3, 5), 5),
}
FAST = {"logreg", "mlp", "cnn", "resnet18"}  # no layer may fall back


def _styles(model: nn.Module) -> list[list[list[str]]]:
    names = [n for n, _ in model.named_parameters()]
    return [[names], [[n] for n in names], [names[: len(names) // 2], names[len(names) // 2 :]]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_builtin_model_matches_general_path(name: str) -> None:
    options, shape, batch = CASES[name]
    torch.manual_seed(0)
    model = models.build_model(config.ModelConfig(name=name, options=options), shape, 3)
    x, y = torch.randn(batch, *shape), torch.arange(batch) % 3

    for groups in _styles(model):
        coef_fn = coefficient_fn("abadi", 0.3, len(groups))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norms, sums = clipped_grad_sum(model, LOSS, x, y, groups, coef_fn)
        fell_back = [str(w.message) for w in caught if w.category is FallbackWarning]
        if name in FAST:
            assert not fell_back, fell_back
        # both norms bound the same exact ones from above (``workers.dp.bounds``); the general
        # path's sums are taken with the fast path's clip factors
        ref_norms, ref_sums = grads.clipped_grad_sum(
            model, LOSS, x, y, groups, lambda _, fn=coef_fn, norms=norms: fn(norms)
        )
        torch.testing.assert_close(norms, ref_norms, rtol=2e-2, atol=1e-7)
        assert (coef_fn(ref_norms) < 1).any()
        for key, value in ref_sums.items():
            scale = value.abs().max().clamp_min(1e-12)
            assert ((sums[key] - value).abs().max() / scale).item() <= 1e-5, key
