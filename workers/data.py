"""Datasets of a trial (no downloads). Each knows its size N, its classes, its splits and
which of them are public: the training split is always private; a validation split is public
when the dataset declares it so (the builtin benchmarks' held-out splits, treated as public
like paper 001's test sets; an ``.npz`` file's ``x_val``/``y_val``). Private validation data is
carved out of the private training data by :func:`hold_out`."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from workers.config import DatasetConfig

Options = dict[str, float | int | str | bool]


@dataclass(frozen=True)
class Dataset:
    name: str
    x: Tensor  # private training inputs, float32, [N, *input_shape]
    y: Tensor  # labels, int64
    num_classes: int
    x_val: Tensor | None = None  # the validation split, if the dataset has one
    y_val: Tensor | None = None
    val_public: bool = False
    class_group: Tensor | None = None  # heavy_tail: frequency group of each class

    @property
    def size(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def splits(self) -> dict[str, str]:
        """Split name → ``"public"`` / ``"private"``."""
        out = {"train": "private"}
        if self.x_val is not None:
            out["val"] = "public" if self.val_public else "private"
        return out


def _options(options: Options, allowed: dict[str, type]) -> Options:
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(f"dataset.options.{key}: unknown option (allowed: {sorted(allowed)})")
        kinds = (int, float) if allowed[key] is float else allowed[key]
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise ValueError(f"dataset.options.{key}: expected {allowed[key].__name__}")
    return options


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[Tensor, ...]:
    order = np.random.default_rng(seed).permutation(len(y))
    cut = len(y) - round(val_fraction * len(y))
    tr, va = order[:cut], order[cut:]
    return (torch.tensor(x[tr], dtype=torch.float32), torch.tensor(y[tr], dtype=torch.long),
            torch.tensor(x[va], dtype=torch.float32), torch.tensor(y[va], dtype=torch.long))


def digits(options: Options) -> Dataset:
    """scikit-learn's 8×8 digits (1797 images, 10 classes) as [1, 8, 8] in [0, 1]; a fixed 20%
    public validation split."""
    from sklearn.datasets import load_digits

    _options(options, {})
    raw = load_digits()
    x, y, x_val, y_val = _split(raw.images[:, None] / 16.0, raw.target, 0.2, seed=0)
    return Dataset("digits", x, y, 10, x_val, y_val, val_public=True)


def mnist1d(options: Options) -> Dataset:
    """MNIST-1D generated procedurally by the ``mnist1d`` package with its fixed seed
    (``num_samples`` option, default 5000; its 80/20 split, the test part public), as [1, 40]."""
    from mnist1d.data import get_dataset_args, make_dataset

    _options(options, {"num_samples": int})
    args = get_dataset_args()
    args.num_samples = int(options.get("num_samples", args.num_samples))
    np_state, py_state = np.random.get_state(), random.getstate()  # it seeds the global RNGs
    try:
        raw = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)

    def t(a: np.ndarray, dtype: torch.dtype) -> Tensor:
        return torch.tensor(a, dtype=dtype)

    return Dataset("mnist1d", t(raw["x"][:, None], torch.float32), t(raw["y"], torch.long), 10,
                   t(raw["x_test"][:, None], torch.float32), t(raw["y_test"], torch.long),
                   val_public=True)


def heavy_tail(options: Options) -> Dataset:
    """Paper 004's synthetic heavy-tailed problem: ``groups`` (8) frequency groups, group i has
    2^i classes of 2^(10−i)·``scale`` samples (at least 1), inputs uniform in [0, 1]^d drawn
    independently of the labels, d = ``dim`` or (largest class size + n) as in the paper
    (n = 8192, d = 9216, c = 255 at scale 1). Training metrics only: it has no validation split."""
    _options(options, {"groups": int, "scale": float, "dim": int, "seed": int})
    groups, scale = int(options.get("groups", 8)), float(options.get("scale", 1.0))
    if not 1 <= groups <= 10:
        raise ValueError("dataset.options.groups: must be between 1 and 10")
    if scale <= 0:
        raise ValueError("dataset.options.scale: must be positive")
    sizes = [max(1, round(2 ** (10 - i) * scale)) for i in range(groups)]
    per_class = [size for i, size in enumerate(sizes) for _ in range(2**i)]
    y = torch.repeat_interleave(torch.arange(len(per_class)), torch.tensor(per_class))
    dim = int(options.get("dim", sizes[0] + len(y)))
    generator = torch.Generator().manual_seed(int(options.get("seed", 0)))
    x = torch.rand(len(y), dim, generator=generator)
    class_group = torch.repeat_interleave(torch.arange(groups), 2 ** torch.arange(groups))
    return Dataset("heavy_tail", x, y, len(per_class), class_group=class_group)


def npz(path: str) -> Dataset:
    """A user file with ``x``, ``y`` (private) and optional ``x_val``, ``y_val`` (public)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset.source: no such file {path!r}")
    with np.load(file, allow_pickle=False) as raw:
        arrays = {k: raw[k] for k in raw.files}
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"dataset.source: {path!r} has no array {key!r}")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ValueError(f"dataset.source: {path!r} needs both x_val and y_val, or neither")
    labels = [arrays["y"]] + ([arrays["y_val"]] if "y_val" in arrays else [])
    for key, x, y in [("y", arrays["x"], arrays["y"]),
                      ("y_val", arrays.get("x_val"), arrays.get("y_val"))]:
        if y is None:
            continue
        if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
            raise ValueError(f"dataset.source: {key} must be non-negative integer labels, "
                             "one per row of the inputs")
    num_classes = int(max(int(a.max()) for a in labels)) + 1
    x_val = arrays.get("x_val")
    return Dataset(file.stem, torch.tensor(arrays["x"], dtype=torch.float32),
                   torch.tensor(arrays["y"], dtype=torch.long), num_classes,
                   None if x_val is None else torch.tensor(x_val, dtype=torch.float32),
                   None if x_val is None else torch.tensor(arrays["y_val"], dtype=torch.long),
                   val_public=x_val is not None)


BUILTINS = {"digits": digits, "mnist1d": mnist1d, "heavy_tail": heavy_tail}


def load_dataset(cfg: DatasetConfig, data_dir: Path | None = None) -> Dataset:
    """Build the dataset of ``cfg``; a relative ``npz:`` path is resolved against
    ``data_dir`` (the service's DATA_DIR) when given."""
    kind, _, name = cfg.source.partition(":")
    if kind == "npz":
        if cfg.options:
            raise ValueError("dataset.options: .npz datasets take no options")
        return npz(str(data_dir / name) if data_dir else name)
    return BUILTINS[name](cfg.options)


@dataclass(frozen=True)
class DatasetInfo:
    """What the control plane records when a dataset is registered."""

    n: int
    num_classes: int
    input_shape: tuple[int, ...]
    public_validation: bool


def describe(source: str, data_dir: Path | None = None,
             options: Options | None = None) -> DatasetInfo:
    d = load_dataset(DatasetConfig(source=source, options=options or {}), data_dir)
    return DatasetInfo(d.size, d.num_classes, d.input_shape, d.splits.get("val") == "public")


def hold_out(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """Move a random ``fraction`` of the private training data into a *private* validation
    split (replacing any public one): used when the selection score is computed privately."""
    order = torch.randperm(dataset.size, generator=torch.Generator().manual_seed(seed))
    cut = dataset.size - max(1, round(fraction * dataset.size))
    if cut < 1:
        raise ValueError("validation.fraction: leaves no training data")
    train, val = order[:cut], order[cut:]
    return replace(dataset, x=dataset.x[train], y=dataset.y[train],
                   x_val=dataset.x[val], y_val=dataset.y[val], val_public=False)
