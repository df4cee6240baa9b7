"""Datasets of a trial (no downloads). Each knows its size N, its classes, its splits and
which of them are public: the training split is always private; a validation split is public
when the dataset declares it so (the builtin benchmarks' held-out splits, treated as public
like paper 001's test sets; an ``.npz`` file's ``x_val``/``y_val``; a CSV or Parquet table has
none). Private validation data is carved out of the private training data by
:func:`hold_out`."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from zipfile import BadZipFile, ZipFile, ZipInfo

import numpy as np
import pandas as pd
import torch
from pyarrow import ArrowException
from pyarrow.parquet import read_metadata
from torch import Tensor

from core.config import DatasetConfig
from workers.dp.randomness import SecureStream

Options = dict[str, float | int | str | bool | list[str]]


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
    return (
        torch.tensor(x[tr], dtype=torch.float32),
        torch.tensor(y[tr], dtype=torch.long),
        torch.tensor(x[va], dtype=torch.float32),
        torch.tensor(y[va], dtype=torch.long),
    )


def digits(options: Options) -> Dataset:
    """scikit-learn's 8×8 digits (1797 images, 10 classes) as [1, 8, 8] in [0, 1]; a fixed 20%
    public validation split.

    Read as ``sklearn.datasets.load_digits`` reads it — the CSV file scikit-learn ships, 64
    pixel values then the label on each row — but without importing scikit-learn, whose
    ``datasets`` module is slow to import and would delay each trial process's first data
    read (``tests/workers/test_data.py`` checks the arrays against ``load_digits``)."""
    _options(options, {})
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    assert spec is not None and spec.origin is not None, "scikit-learn is a dependency"
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    x, y, x_val, y_val = _split(images[:, None] / 16.0, target, 0.2, seed=0)
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

    return Dataset(
        "mnist1d",
        t(raw["x"][:, None], torch.float32),
        t(raw["y"], torch.long),
        10,
        t(raw["x_test"][:, None], torch.float32),
        t(raw["y_test"], torch.long),
        val_public=True,
    )


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


#: the arrays an ``.npz`` dataset may hold; other members of the archive are never read
NPZ_ARRAYS = ("x", "y", "x_val", "y_val")


def npz(path: Path, num_classes: int) -> Dataset:
    """A user file with ``x``, ``y`` (private) and optional ``x_val``, ``y_val`` (public)."""
    with _reading("npz"), _npz_members(path) as (archive, members):
        arrays = {}
        for key, info in members.items():
            with archive.open(info) as member:
                arrays[key] = np.lib.format.read_array(member, allow_pickle=False)
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"dataset.source: the file has no array {key!r}")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ValueError("dataset.source: the file needs both x_val and y_val, or neither")
    for key, x, y in [
        ("y", arrays["x"], arrays["y"]),
        ("y_val", arrays.get("x_val"), arrays.get("y_val")),
    ]:
        if y is not None and (
            y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer)
        ):
            raise ValueError(
                f"dataset.source: {key} must be integer labels, one per row of the inputs"
            )
    x_val = arrays.get("x_val")
    return Dataset(
        path.stem,
        torch.tensor(arrays["x"], dtype=torch.float32),
        torch.tensor(arrays["y"], dtype=torch.long),
        num_classes,
        None if x_val is None else torch.tensor(x_val, dtype=torch.float32),
        None if x_val is None else torch.tensor(arrays["y_val"], dtype=torch.long),
        val_public=x_val is not None,
    )


def table(frame: pd.DataFrame, label: str, features: list[str] | None) -> tuple[Tensor, Tensor]:
    """Inputs and labels of a CSV or Parquet table, one example per row: the ``label`` column
    holds integer labels, the ``features`` columns (default: all the others) numbers, an
    example's input is the vector of its features. Rows count from 0 without the header, as
    ``x[i]`` and ``y[i]`` do."""
    if frame.empty:  # before the column types, which an empty column does not have
        raise ValueError("dataset.source: the data has no examples")
    features = features or [str(c) for c in frame.columns if c != label]
    for field, column in [("label", label), *(("features", c) for c in features)]:
        if column not in frame.columns:
            raise ValueError(
                f"dataset.options.{field}: no column {column!r} (the file has "
                f"{[str(c) for c in frame.columns]})"
            )
    if not features:
        raise ValueError("dataset.options.features: the file has no column besides the label")
    for column in features:
        if not pd.api.types.is_numeric_dtype(frame[column]):
            raise ValueError(
                f"dataset.options.features: column {column!r} is not numeric "
                f"({_first_bad(frame[column], 'x', integral=False)})"
            )
    labels = frame[label]
    if not pd.api.types.is_integer_dtype(labels) or labels.isna().any():
        raise ValueError(
            f"dataset.options.label: column {label!r} must hold integer labels "
            f"({_first_bad(labels, 'y', integral=True)})"
        )
    x = frame[features].to_numpy(dtype=np.float64, na_value=np.nan)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(labels.to_numpy(dtype=np.int64))


def _first_bad(values: pd.Series, name: str, integral: bool) -> str:
    """The first value of ``values`` that is no number (no integer if ``integral``), or, when
    each one is, the column's type."""
    numbers = pd.to_numeric(values, errors="coerce")
    bad = numbers.isna()
    if integral:
        bad |= numbers.fillna(0) % 1 != 0
    if bad.any():
        row = int(bad.to_numpy().argmax())
        value = values.iloc[row]
        return f"{name}[{row}] is {value.item() if isinstance(value, np.generic) else value!r}"
    return f"its type is {values.dtype}"


def table_file(kind: str, path: Path, options: Options, num_classes: int) -> Dataset:
    """A CSV file with a header row (plain text: pandas would otherwise inflate a name ending
    in ``.gz`` or ``.zip``), or a Parquet file, as :func:`table` reads it."""
    with _reading(kind):
        frame = pd.read_csv(path, compression=None) if kind == "csv" else pd.read_parquet(path)
    features = options.get("features")
    x, y = table(frame, str(options["label"]), features if isinstance(features, list) else None)
    return Dataset(path.stem, x, y, num_classes)


@contextmanager
def _reading(kind: str) -> Iterator[None]:
    """A file that does not parse as ``kind`` is a ``dataset.source`` error, whatever its
    parser raises for it (pandas, pyarrow, numpy or zipfile)."""
    try:
        yield
    except (
        ValueError,
        OSError,
        EOFError,
        BadZipFile,
        NotImplementedError,  # a zip member's compression method that zipfile lacks
        zlib.error,
        ArrowException,
    ) as error:
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise ValueError(f"dataset.source: not a readable {kind} file ({reason})") from None


@contextmanager
def _npz_members(path: Path) -> Iterator[tuple[ZipFile, dict[str, ZipInfo]]]:
    """The archive of an ``.npz`` file and its members that hold the dataset's arrays
    (``x.npy`` …), none of them read yet."""
    with path.open("rb") as f:
        if f.read(len(np.lib.format.MAGIC_PREFIX)) == np.lib.format.MAGIC_PREFIX:
            raise ValueError("a single .npy array, not an .npz archive")
    with ZipFile(path) as archive:
        names = set(archive.namelist())
        yield archive, {k: archive.getinfo(f"{k}.npy") for k in NPZ_ARRAYS if f"{k}.npy" in names}


#: a file may declare at most this many times its own size of data (unless it declares little)
MAX_RATIO = 100
#: what a file may declare whatever its own size
RATIO_FLOOR = 16 * 1024**2
_NPY_HEADERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def check_size(kind: str, path: Path, max_bytes: int) -> None:
    """Refuse a file whose data would take more than ``max_bytes`` once read, or over
    ``MAX_RATIO`` times the file's own size (a decompression bomb), from what the file
    declares, before any of its data is inflated: the control plane reads a file it registers
    whole, in its own memory."""
    with _reading(kind):
        declared_bytes = _DECLARED_BYTES[kind](path)
    stored = path.stat().st_size
    if declared_bytes > max_bytes:
        raise ValueError(
            f"dataset.source: the {kind} file declares {declared_bytes} bytes of data, more "
            f"than the {max_bytes} the service reads (DPTUNE_MAX_DATASET_BYTES)"
        )
    if declared_bytes > max(RATIO_FLOOR, MAX_RATIO * stored):
        raise ValueError(
            f"dataset.source: the {kind} file declares {declared_bytes} bytes of data in "
            f"{stored}, over {MAX_RATIO} times its size, and is refused as a decompression "
            "bomb; store the data uncompressed (numpy.savez, or Parquet without compression "
            "and dictionaries)"
        )


def _npz_bytes(path: Path) -> int:
    """Each array's size as its ``.npy`` header declares it (shape × item size: what numpy
    allocates) or as the archive does (what zipfile inflates), whichever is larger; only the
    headers are inflated."""
    with _npz_members(path) as (archive, members):
        return sum(max(m.file_size, _npy_bytes(archive, m)) for m in members.values())


def _npy_bytes(archive: ZipFile, info: ZipInfo) -> int:
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version not in _NPY_HEADERS:
            raise ValueError(f"{info.filename}: .npy format version {version} is not supported")
        shape, _, dtype = _NPY_HEADERS[version](member)
    if any(size < 0 for size in shape):
        raise ValueError(f"{info.filename}: a negative dimension in {shape}")
    return math.prod(shape) * dtype.itemsize


def _parquet_bytes(path: Path) -> int:
    """From the file's footer: its row groups' uncompressed size, or, if more, 8 bytes for each
    value (pandas holds numbers in 64 bits; a run-length encoded column is small on disk)."""
    meta = read_metadata(path)
    uncompressed = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return int(max(uncompressed, meta.num_rows * meta.num_columns * 8))


def _csv_bytes(path: Path) -> int:
    """The text's own size: parsed, a value takes 8 bytes, at most four times its text with
    its separator (``0,``), so the file's size bounds what it becomes."""
    return path.stat().st_size


_DECLARED_BYTES = {"npz": _npz_bytes, "parquet": _parquet_bytes, "csv": _csv_bytes}
BUILTINS = {"digits": digits, "mnist1d": mnist1d, "heavy_tail": heavy_tail}
#: file formats, by the ``source`` prefix that names them (``csv:<path under DATA_DIR>``)
FILE_FORMATS = ("npz", "csv", "parquet")


def declared(kind: str, options: Options, num_classes: int | None) -> int:
    """Check what a file dataset declares before its file is read (also when an upload is
    announced): the options of its format, and the label set {0, …, ``num_classes`` − 1},
    which is public, so it is declared, never read off the private labels."""
    if kind == "npz":
        _options(options, {})
    else:
        _options(options, {"label": str, "features": list})
        if "label" not in options:
            raise ValueError(f"dataset.options.label: required for {kind} datasets")
        features = options.get("features")
        if isinstance(features, list) and (
            not features
            or not all(isinstance(f, str) for f in features)
            or len(set(features)) != len(features)
            or options["label"] in features
        ):
            raise ValueError(
                "dataset.options.features: a list of distinct column names, without the label"
            )
    if num_classes is None:
        raise ValueError(
            f"dataset.num_classes: required for {kind} datasets (the label set is "
            "declared, not read from private data)"
        )
    return num_classes


def load_dataset(
    cfg: DatasetConfig, data_dir: Path | None = None, max_bytes: int | None = None
) -> Dataset:
    """Build the dataset of ``cfg`` and check it (:func:`check`): registration, uploads and
    every trial read data through here. A relative file path is resolved against ``data_dir``
    (the service's DATA_DIR) when given. With ``max_bytes`` (the control plane's bound), a file
    is first checked by :func:`check_size`; a trial reads a file registered under that bound,
    whose content it checks against the registered hash."""
    kind, _, name = cfg.source.partition(":")
    if kind in FILE_FORMATS:
        path = data_dir / name if data_dir else Path(name)
        if not path.is_file():
            raise ValueError(f"dataset.source: no such file {name!r}")
        num_classes = declared(kind, cfg.options, cfg.num_classes)
        if max_bytes is not None:
            check_size(kind, path, max_bytes)
        dataset = (
            npz(path, num_classes)
            if kind == "npz"
            else table_file(kind, path, cfg.options, num_classes)
        )
    else:
        dataset = BUILTINS[name](cfg.options)
        if cfg.num_classes not in (None, dataset.num_classes):
            raise ValueError(
                f"dataset.num_classes: {cfg.source} has {dataset.num_classes} "
                f"classes, not {cfg.num_classes}"
            )
    check(dataset)
    if cfg.sha256 is not None and content_sha256(dataset) != cfg.sha256:
        raise ValueError(
            f"dataset.sha256: the data of {cfg.source} changed since it was "
            "registered; its privacy cost was planned from the registered data"
        )
    return dataset


#: datasets a process keeps loaded (:func:`load_cached`): a job reads one, a worker process
#: runs trials of one job; the bound only caps what a long-lived process may hold
CACHED_DATASETS = 2
_cache: OrderedDict[tuple[object, ...], Dataset] = OrderedDict()


def _cache_key(cfg: DatasetConfig, data_dir: Path | None) -> tuple[object, ...]:
    """What identifies loaded data: the config (with the content hash registered with it) and,
    for a file, its resolved path and the identity and version of what is there now (inode,
    size, modification time) — an upload replaces the file (a new inode), so data read before
    it is never served after it, and the reload checks the new bytes against ``sha256``."""
    kind, _, name = cfg.source.partition(":")
    if kind not in FILE_FORMATS:
        return (cfg.model_dump_json(),)
    path = (data_dir / name if data_dir else Path(name)).resolve()
    try:
        stat = path.stat()
    except OSError:
        return (cfg.model_dump_json(), str(path))  # load_dataset says what is wrong
    return (cfg.model_dump_json(), str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def load_cached(cfg: DatasetConfig, data_dir: Path | None = None) -> Dataset:
    """:func:`load_dataset`, once per process for the same data: the trials of a job that
    reuse one worker process read, check and hash the dataset once. The arrays are shared
    between trials, so a trial must not write into them (:func:`workers.trial.run_trial`
    trains on copies); everything random about a trial (hold-out, batches, noise) is drawn
    afterwards, per trial, from fresh entropy."""
    key = _cache_key(cfg, data_dir)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    dataset = load_dataset(cfg, data_dir)
    _cache[key] = dataset
    while len(_cache) > CACHED_DATASETS:
        _cache.popitem(last=False)
    return dataset


def _first_bad_row(bad: Tensor) -> int | None:
    rows = bad.reshape(len(bad), -1).any(1).nonzero()
    return int(rows[0]) if len(rows) else None


def check(dataset: Dataset) -> None:
    """docs/design.md, invariant 9: refuse non-finite features (a NaN or inf record would otherwise
    reach the clipper — values beyond float32's range are inf once converted) and labels
    outside the declared label set, naming the array and its first offending row."""
    if dataset.size == 0:
        raise ValueError("dataset.source: the data has no examples")
    for key, x, y in [("x", dataset.x, dataset.y), ("x_val", dataset.x_val, dataset.y_val)]:
        if x is None or y is None:
            continue
        row = _first_bad_row(~torch.isfinite(x))
        if row is not None:
            raise ValueError(
                f"dataset.source: {key}[{row}] has a non-finite value (NaN or "
                "±inf, or beyond float32's range)"
            )
        label = "y" if key == "x" else "y_val"
        row = _first_bad_row((y < 0) | (y >= dataset.num_classes))
        if row is not None:
            raise ValueError(
                f"dataset.source: {label}[{row}] = {int(y[row])} is outside the "
                f"declared label set 0…{dataset.num_classes - 1}"
            )


def content_sha256(dataset: Dataset) -> str:
    """SHA-256 of the arrays a trial trains and validates on (shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for tensor in (dataset.x, dataset.y, dataset.x_val, dataset.y_val):
        if tensor is not None:
            digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
            digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetInfo:
    """What the control plane records when a dataset is registered. N and the label set are
    treated as public (q = B/N is computed from N, as DP-SGD's accounting does)."""

    n: int
    num_classes: int
    input_shape: tuple[int, ...]
    public_validation: bool
    sha256: str


def describe(
    source: str,
    data_dir: Path | None = None,
    options: Options | None = None,
    num_classes: int | None = None,
    max_bytes: int | None = None,
) -> DatasetInfo:
    d = load_dataset(
        DatasetConfig(source=source, options=options or {}, num_classes=num_classes),
        data_dir,
        max_bytes,
    )
    return DatasetInfo(
        d.size, d.num_classes, d.input_shape, d.splits.get("val") == "public", content_sha256(d)
    )


def hold_out(dataset: Dataset, fraction: float, stream: SecureStream) -> Dataset:
    """Move each private training example into a *private* validation split independently
    with probability ``fraction`` (replacing any public split): used when the selection score
    is computed privately.

    Independent coin flips keep the add/remove coupling of DP: adding one record leaves every
    other record's side unchanged. A split of fixed size round(f·N) would not — it changes
    with N, so neighbouring datasets would train on sets that differ by a replacement."""
    held = stream.bernoulli(dataset.size, fraction)
    train, val = (~held).nonzero().squeeze(1), held.nonzero().squeeze(1)
    return replace(
        dataset,
        x=dataset.x[train],
        y=dataset.y[train],
        x_val=dataset.x[val],
        y_val=dataset.y[val],
        val_public=False,
    )
