"""A DP step makes no host synchronisation (issue 43): on a GPU every ``.item()``, ``.cpu()``,
``bool(tensor)`` or branch on a tensor's value stalls the host until the device catches up.

On CPU nothing waits, so the steps are watched instead: a ``TorchDispatchMode`` counts
``aten._local_scalar_dense`` (what ``.item()``, ``float()`` and ``bool()`` of a tensor
dispatch), and recorders replace ``Tensor.cpu``, ``.tolist``, ``.numpy``, ``.item`` and
``__bool__`` (``.cpu()`` of a CPU tensor dispatches nothing). The noise is drawn as on a GPU,
by ``workers.dp.normal`` from a generator on the tensor's device: the CPU's own draw reads the
buffer through numpy, which is no sync there. A warm-up step comes first (the fast clipper
chooses each layer's way of forming norms on first use); the next steps must sync nothing
with a fixed threshold. (resnet18 is left out: its steps take seconds on a CPU, and its layers
are the cnn's kinds.)
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.config import ModelConfig
from workers.dp.ghost import clipped_grad_sum
from workers.dp.normal import normal_
from workers.dp.randomness import SecureStream
from workers.models import build_model

ROOT = Path(__file__).resolve().parents[2]
#: model: (input shape, classes, batch size)
MODELS = {
    "mlp": ((3, 32, 32), 10, 8),
    "cnn": ((3, 32, 32), 10, 4),
    "transformer": ((8, 8), 10, 4),
}
WATCHED = ("cpu", "tolist", "numpy", "item", "__bool__")


class DeviceNoise(SecureStream):
    """Test double: the noise as a GPU draws it (``workers.dp.normal``), here on the CPU."""

    def normal(self, shape, *, device="cpu", dtype=torch.float32, out=None, scale=1.0):
        out = torch.empty(shape, device=device, dtype=dtype) if out is None else out
        return normal_(out, torch.Generator(device=out.device), scale)


def _site() -> str:
    """The innermost frame of this repository's code outside this file: where a sync is made."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and path != Path(__file__).resolve():
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


class _Scalars(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen.append(f"{func} at {_site()}")
        return func(*args, **(kwargs or {}))


@contextmanager
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Where host syncs were made inside the block, one entry each."""
    seen: list[str] = []
    with monkeypatch.context() as patch:
        for name in WATCHED:
            original = getattr(torch.Tensor, name)

            def recorded(self, *args, _name=name, _original=original, **kwargs):
                seen.append(f"Tensor.{_name} at {_site()}")
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, recorded)
        with _Scalars(seen):
            yield seen


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("function", ["abadi", "auto_s", "auto_v"])
@pytest.mark.parametrize("style", ["all_layer", "layer_wise", "group"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_steady_step_syncs_nothing(name, style, function, padded, make_step, monkeypatch) -> None:
    """No synchronisation, also with micro-batches padded and C_t written to the device, as a
    GPU trial runs (``workers.dp.graphed``)."""
    shape, classes, batch = MODELS[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), shape, classes)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    groups = style
    if style == "group":  # two groups: the first parameter, then the rest
        names = [n for n, _ in model.named_parameters()]
        groups = [names[:1], names[1:]]
    step = make_step(
        model,
        noise=1.0,
        threshold=1.0,
        expected=batch,
        stream=DeviceNoise(),
        style=groups,
        clipper=clipped_grad_sum,
        clipping=function,
        lr=0.01,
        padded_rows=batch if padded else None,
    )
    step.step([(x, y)], 0)  # warm-up
    with syncs(monkeypatch) as seen:
        for t in (1, 2):
            step.step([(x[: batch // 2], y[: batch // 2]), (x[batch // 2 :], y[batch // 2 :])], t)
    assert seen == [], "\n".join(seen)
