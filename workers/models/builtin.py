"""The built-in models, built from a name, options and the dataset's input shape.

Inputs are vectors [D], signals [C, L] or images [C, H, W]; convolutional models use 1-D or
2-D convolutions accordingly, sequence models read a signal as L steps of C features and an
image as H steps of C·W features. No BatchNorm (per-example gradients need examples to be
independent): the ResNets use GroupNorm, as in paper 001. No dropout, so that the per-sample
gradient of an example is a deterministic function of the parameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.config import BUILTIN_OPTIONS, ModelConfig

Shape = tuple[int, ...]
Options = dict[str, float | int | str | bool]


def _int(options: Options, key: str, default: int) -> int:
    value = options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.options.{key}: expected a positive integer")
    return value


def _spatial(shape: Shape, name: str) -> int:
    if len(shape) not in (2, 3):
        raise ValueError(
            f"model.name: {name!r} needs signal [C, L] or image [C, H, W] inputs, "
            f"got shape {list(shape)}"
        )
    return len(shape) - 1


def _conv(dims: int) -> type[nn.Conv1d] | type[nn.Conv2d]:
    return nn.Conv1d if dims == 1 else nn.Conv2d


def _pool(dims: int) -> type[nn.MaxPool1d] | type[nn.MaxPool2d]:
    return nn.MaxPool1d if dims == 1 else nn.MaxPool2d


def _flat_size(features: nn.Module, shape: Shape) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *shape)).numel())


def logreg(shape: Shape, classes: int, options: Options) -> nn.Module:
    """Linear softmax classifier (paper 004's linear model; ``bias`` option, default true)."""
    bias = options.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError("model.options.bias: expected true or false")
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), classes, bias=bias))


def mlp(shape: Shape, classes: int, options: Options) -> nn.Module:
    """``layers`` (2) hidden ReLU layers of width ``hidden`` (128)."""
    hidden, layers = _int(options, "hidden", 128), _int(options, "layers", 2)
    widths = [math.prod(shape)] + [hidden] * layers
    body: list[nn.Module] = [nn.Flatten()]
    for a, b in itertools.pairwise(widths):
        body += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(widths[-1], classes))


def cnn(shape: Shape, classes: int, options: Options) -> nn.Module:
    """Paper 001's small two-convolution CNN (the Opacus MNIST model: 16 8×8 filters stride 2,
    32 4×4 filters stride 2, each followed by a 2×2 max-pool of stride 1, then a 32-unit dense
    layer). Inputs smaller than 28 (e.g. 8×8 digits) cannot take those kernels and get the same
    two-conv structure with 3-wide kernels, padding 1 and 2× pooling."""
    dims = _spatial(shape, "cnn")
    conv, pool = _conv(dims), _pool(dims)
    if min(shape[1:]) >= 28:
        features = nn.Sequential(
            conv(shape[0], 16, 8, 2, padding=3),
            nn.ReLU(),
            pool(2, 1),
            conv(16, 32, 4, 2),
            nn.ReLU(),
            pool(2, 1),
            nn.Flatten(),
        )
    else:
        features = nn.Sequential(
            conv(shape[0], 16, 3, padding=1),
            nn.ReLU(),
            pool(2),
            conv(16, 32, 3, padding=1),
            nn.ReLU(),
            pool(2),
            nn.Flatten(),
        )
    return nn.Sequential(
        features, nn.Linear(_flat_size(features, shape), 32), nn.ReLU(), nn.Linear(32, classes)
    )


class BasicBlock(nn.Module):
    def __init__(
        self, dims: int, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        conv = _conv(dims)
        self.conv1 = conv(cin, cout, 3, stride, padding=1, bias=False)
        self.norm1 = norm(cout)
        self.conv2 = conv(cout, cout, 3, 1, padding=1, bias=False)
        self.norm2 = norm(cout)
        self.shortcut = (
            nn.Sequential(conv(cin, cout, 1, stride, bias=False), norm(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


def resnet(blocks: list[int]) -> Callable[[Shape, int, Options], nn.Module]:
    def build(shape: Shape, classes: int, options: Options) -> nn.Module:
        """CIFAR-style ResNet (3×3 stem, no max-pool) with GroupNorm in place of BatchNorm:
        gcd(``norm_groups``, C/2) groups (Opacus' gcd(32, C) at the usual widths, but at least
        two channels a group so that 1×1 feature maps of small inputs still normalise);
        base width ``width`` (64)."""
        dims = _spatial(shape, "resnet")
        width, groups = _int(options, "width", 64), _int(options, "norm_groups", 32)

        def norm(c: int) -> nn.Module:
            return nn.GroupNorm(math.gcd(groups, max(1, c // 2)), c)

        layers: list[nn.Module] = [
            _conv(dims)(shape[0], width, 3, 1, padding=1, bias=False),
            norm(width),
            nn.ReLU(),
        ]
        cin = width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(dims, cin, cout, 2 if stage and not i else 1, norm))
                cin = cout
        pool = nn.AdaptiveAvgPool1d(1) if dims == 1 else nn.AdaptiveAvgPool2d(1)
        return nn.Sequential(*layers, pool, nn.Flatten(), nn.Linear(cin, classes))

    return build


class ToSequence(nn.Module):
    """[B, C, L] → [B, L, C]; [B, C, H, W] → [B, H, C·W]."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3:
            return x.transpose(1, 2)
        return x.permute(0, 2, 1, 3).flatten(2)


def _sequence_shape(shape: Shape, name: str) -> tuple[int, int]:
    _spatial(shape, name)
    if len(shape) == 2:
        return shape[1], shape[0]
    return shape[1], shape[0] * shape[2]


class LSTMLayer(nn.Module):
    """One LSTM layer from two Linear maps (the gates of ``nn.LSTM``, with one bias instead of
    its two redundant ones). ``nn.LSTM``'s fused kernels have no vmap batching rule (and the
    float64/CUDA ones fail under vmap), while Linear layers work on every per-sample path."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.input = nn.Linear(features, 4 * hidden)
        self.recurrent = nn.Linear(hidden, 4 * hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        inputs = self.input(x)  # [B, T, 4H], all steps at once
        h = c = inputs.new_zeros(len(x), self.recurrent.in_features)
        outputs = []
        for t in range(x.shape[1]):
            i, f, g, o = (inputs[:, t] + self.recurrent(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class LSTMClassifier(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.to_sequence = ToSequence()
        self.layers = nn.Sequential(
            *[LSTMLayer(features if i == 0 else hidden, hidden) for i in range(layers)]
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(self.to_sequence(x))[:, -1])


def lstm(shape: Shape, classes: int, options: Options) -> nn.Module:
    """An LSTM (``hidden`` 64, ``layers`` 1) read out at the last step."""
    _, features = _sequence_shape(shape, "lstm")
    return LSTMClassifier(
        features, _int(options, "hidden", 64), _int(options, "layers", 1), classes
    )


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block built from Linear and LayerNorm layers."""

    def __init__(self, dim: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ff1, self.ff2 = nn.Linear(dim, ff), nn.Linear(ff, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class TransformerClassifier(nn.Module):
    def __init__(
        self, length: int, features: int, classes: int, dim: int, heads: int, layers: int, ff: int
    ) -> None:
        super().__init__()
        self.to_sequence = ToSequence()
        self.embed = nn.Linear(features, dim)
        self.position = nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads, ff) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.register_buffer("positions", torch.arange(length), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # positions indexed per example, so that every parameter sees a per-sample batch
        h = self.embed(self.to_sequence(x)) + self.position(self.positions.expand(len(x), -1))
        return self.head(self.norm(self.blocks(h)).mean(1))


def transformer(shape: Shape, classes: int, options: Options) -> nn.Module:
    """A small transformer-encoder classifier (``dim`` 64, ``heads`` 4, ``layers`` 2, ``ff``
    128) with learned positions and mean pooling."""
    length, features = _sequence_shape(shape, "transformer")
    dim, heads = _int(options, "dim", 64), _int(options, "heads", 4)
    if dim % heads:
        raise ValueError("model.options.heads: must divide model.options.dim")
    return TransformerClassifier(
        length, features, classes, dim, heads, _int(options, "layers", 2), _int(options, "ff", 128)
    )


BUILDERS: dict[str, Callable[[Shape, int, Options], nn.Module]] = {
    "logreg": logreg,
    "mlp": mlp,
    "cnn": cnn,
    "resnet18": resnet([2, 2, 2, 2]),
    "resnet34": resnet([3, 4, 6, 3]),
    "lstm": lstm,
    "transformer": transformer,
}

#: Options each model reads (declared in ``core.config``, where admission checks them too);
#: anything else is rejected with the option's name.
OPTIONS = {name: set(options) for name, options in BUILTIN_OPTIONS.items()}


def build_builtin(cfg: ModelConfig, input_shape: Shape, num_classes: int) -> nn.Module:
    unknown = set(cfg.options) - OPTIONS[cfg.name]
    if unknown:
        raise ValueError(
            f"model.options.{sorted(unknown)[0]}: not an option of {cfg.name!r} "
            f"(allowed: {sorted(OPTIONS[cfg.name])})"
        )
    return BUILDERS[cfg.name](input_shape, num_classes, cfg.options)
