"""Model factories that live outside dptune, as an operator's own package would: importable
because ``tests/models_pkg`` is on the path (``sys.path`` in the tests, ``PYTHONPATH`` of the
Ray head in tests/e2e). Each is ``factory(input_shape=..., num_classes=..., **options)``.

``group_norm_cnn`` and ``recurrent`` are fit for DP-SGD; the others each break one rule of
``workers.models.inspect``, and ``recorder`` writes its inputs' mean into state the DP optimizer
does not update (``workers.release``).
"""

from __future__ import annotations

import math
from os import getpid, getppid  # imported, not defined here: not factories of this module

import torch
from torch import Tensor, nn


def group_norm_cnn(
    input_shape: tuple[int, ...], num_classes: int, width: int = 8, groups: int = 2
) -> nn.Module:
    """A small CNN for images [C, H, W]: conv, GroupNorm, ReLU, 2× pooling, linear head."""
    channels, height, width_in = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.GroupNorm(groups, width),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(width * (height // 2) * (width_in // 2), num_classes),
    )


def batch_norm_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``group_norm_cnn`` with BatchNorm: it mixes the examples of a batch."""
    model = group_norm_cnn(input_shape, num_classes)
    model[1] = nn.BatchNorm2d(8)
    return model


def instance_norm_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``group_norm_cnn`` with an InstanceNorm that keeps running statistics of the data."""
    model = group_norm_cnn(input_shape, num_classes)
    model[1] = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
    return model


def lazy_head(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A head whose input size is left to the first forward pass."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))


class Recurrent(nn.Module):
    """An ``nn.LSTM`` over the rows of an image: no fast rule, so the general path."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_shape[0] * input_shape[2], hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.permute(0, 2, 1, 3).flatten(2)  # [B, H, C·W]
        return self.head(self.lstm(rows)[0][:, -1])


def recurrent(input_shape: tuple[int, ...], num_classes: int, hidden: int = 6) -> nn.Module:
    return Recurrent(input_shape, num_classes, hidden)


class BatchCentre(nn.Module):
    """Subtracts the batch mean: a layer that mixes examples, unknown to any list of names."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0, keepdim=True)


def batch_centred(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), BatchCentre(), nn.Linear(math.prod(input_shape), num_classes)
    )


def dropout_mlp(input_shape: tuple[int, ...], num_classes: int, p: float = 0.5) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Dropout(p), nn.Linear(math.prod(input_shape), num_classes)
    )


class Positions(nn.Module):
    """Adds a learned embedding of the row positions, looked up once for the whole batch
    ([H, d], broadcast): that Embedding is not called on a per-sample batch."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.embed = nn.Linear(channels * width, 8)
        self.position = nn.Embedding(height, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        rows = self.embed(x.permute(0, 2, 1, 3).flatten(2))  # [B, H, 8]
        positions = self.position(torch.arange(rows.shape[1], device=x.device))  # [H, 8]
        return self.head(torch.tanh(rows + positions).mean(1))


def shared_positions(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return Positions(input_shape, num_classes)


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs in a buffer (released with the weights)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


def running_mean(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    features = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), RunningMean(features), nn.Linear(features, num_classes))


class Recorder(nn.Module):
    """Writes the mean of its inputs into its own state in the forward pass, outside the
    optimizer, and passes them on unchanged. ``keep`` says where: a frozen ``Parameter``
    (``frozen``), a buffer (``buffer``), a buffer in training mode only (``train_buffer``), a
    buffer only on inputs holding an exact zero, which a dummy batch of standard normals never
    does (``sparse_buffer``), a buffer registered in the first forward pass (``later``), or a plain
    tensor attribute (``attribute``). ``writes`` counts the forward passes that wrote."""

    def __init__(self, features: int, keep: str) -> None:
        super().__init__()
        self.keep, self.writes = keep, 0
        if keep == "frozen":
            self.stat = nn.Parameter(torch.zeros(features), requires_grad=False)
        elif keep in ("buffer", "train_buffer", "sparse_buffer"):
            self.register_buffer("stat", torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        mean = x.detach().mean(0)
        if self.keep == "attribute":
            self.stat = mean
        elif self.keep == "later" and "stat" not in self._buffers:
            self.register_buffer("stat", mean.clone())
        elif self._records(x):
            self.stat.data.copy_(mean)
        else:
            return x
        self.writes += 1
        return x

    def _records(self, x: Tensor) -> bool:
        if self.keep == "train_buffer":
            return self.training
        if self.keep == "sparse_buffer":
            return bool((x == 0).any())
        return True


def recorder(input_shape: tuple[int, ...], num_classes: int, keep: str = "frozen") -> nn.Module:
    """A linear model that keeps the mean of its inputs as ``1.stat`` (``Recorder``)."""
    features = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), Recorder(features, keep), nn.Linear(features, num_classes))


def wrong_output(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes + 1))


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> object:
    return [input_shape, num_classes]


def skewed(input_shape: tuple[int, ...], num_classes: int, planner_pid: int) -> nn.Module:
    """``group_norm_cnn`` in the process ``planner_pid`` (the control plane of a test),
    ``batch_norm_cnn`` in every other one: the package installed on the workers differs from
    the control plane's."""
    if planner_pid in (getpid(), getppid()):  # the control plane inspects in a child
        return group_norm_cnn(input_shape, num_classes)
    return batch_norm_cnn(input_shape, num_classes)
