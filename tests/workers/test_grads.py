"""Per-sample gradients, norms and clipped sums of the general path against a naive loop."""

import math

import pytest
import torch
from torch import nn

from core.config import ModelConfig
from workers.dp import clipped_grad_sum, per_sample_grad_norms, resolve_groups
from workers.dp.clipping import coefficient_fn
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
SMALL = {
    "mlp": {"hidden": 16},
    "resnet18": {"width": 4},
    "resnet34": {"width": 4},
    "lstm": {"hidden": 8},
    "transformer": {"dim": 8, "heads": 2, "layers": 1, "ff": 16},
}
MODELS = ["logreg", "mlp", "cnn", "resnet18", "resnet34", "lstm", "transformer"]


def naive_grads(model, x, y):
    """One backward pass per example."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        model.zero_grad()
        LOSS(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        rows.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return {n: torch.stack([r[n] for r in rows]) for n in names}


def model_and_batch(name, shape, seed=0):
    """In float64, so that the comparison tests the math rather than float32 rounding (tiny
    GroupNorm groups at 1×1 resolution have large, ill-conditioned gradients)."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name=name, options=SMALL.get(name, {})), shape, 5).double()
    return model, torch.randn(4, *shape, dtype=torch.float64), torch.randint(0, 5, (4,))


# resnet34 differs from resnet18 only in depth: one style is enough (and keeps CI fast).
CASES = [
    pytest.param(name, shape, style, id=f"{name}-{kind}-{style}")
    for name in MODELS
    for kind, shape in [("image", (1, 8, 8)), ("signal", (2, 12))]
    for style in ["all_layer", "layer_wise", "param_wise"]
    if name != "resnet34" or style == "all_layer"
]


@pytest.mark.parametrize(("name", "shape", "style"), CASES)
def test_norms_and_clipped_sums_match_naive_loop(name, shape, style):
    model, x, y = model_and_batch(name, shape)
    reference = naive_grads(model, x, y)
    groups = resolve_groups(model, style)
    expected = torch.tensor(
        [
            [math.sqrt(sum(float(reference[n][i].pow(2).sum()) for n in g)) for g in groups]
            for i in range(len(y))
        ],
        dtype=torch.float64,
    )
    norms = per_sample_grad_norms(model, LOSS, x, y, style)
    assert_upper_bound(norms, expected)

    coef_fn = coefficient_fn("abadi", 0.5, len(groups))
    got_norms, sums = clipped_grad_sum(model, LOSS, x, y, groups, coef_fn)
    assert_upper_bound(got_norms, expected)
    coef = coef_fn(got_norms).double()  # the factors of the clipper's own bounds
    for m, group in enumerate(groups):
        for n in group:
            want = sum(coef[i, m] * reference[n][i] for i in range(len(y)))
            torch.testing.assert_close(sums[n].double(), want.double(), rtol=1e-5, atol=1e-7)
    assert set(sums) == set(reference)


def assert_upper_bound(norms: torch.Tensor, exact: torch.Tensor) -> None:
    """Float32 bounds (``workers.dp.bounds``): at least the exact norms (up to the reference's
    own float32 gradients' rounding, 1e-6), at most 3e-4 above them."""
    assert norms.dtype == torch.float32
    assert (norms.double() >= exact * (1 - 1e-6)).all(), (norms, exact)
    assert (norms.double() <= exact * (1 + 3e-4) + 1e-12).all(), (norms, exact)


def test_groups_by_prefix_and_errors():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert resolve_groups(model, [["0"], ["2.weight", "2.bias"]]) == [
        ["0.weight", "0.bias"],
        ["2.weight", "2.bias"],
    ]
    assert resolve_groups(model, "layer_wise") == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert len(resolve_groups(model, "param_wise")) == 4
    assert resolve_groups(model, None) == [["0.weight", "0.bias", "2.weight", "2.bias"]]
    with pytest.raises(ValueError, match=r"method.groups.*'2.bias'.*no group"):
        resolve_groups(model, [["0"], ["2.weight"]])
    with pytest.raises(ValueError, match=r"method.groups.*groups"):
        resolve_groups(model, [["0", "2"], ["2"]])
    with pytest.raises(ValueError, match=r"method.groups\[1\]"):
        resolve_groups(model, [["0", "2"], ["1"]])


def test_frozen_parameters_are_not_grouped():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(3, 3), torch.randint(0, 2, (3,))
    norms = per_sample_grad_norms(model, LOSS, x, y, "param_wise")
    assert norms.shape == (3, 3)
