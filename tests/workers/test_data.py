"""Datasets: sizes, classes, splits and which are public; what a file declares is checked
before it is inflated (issue 39, finding 10; the bombs through the API:
``tests/service/test_dataset_sizes.py``)."""

import gzip
import struct
import zipfile

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import DatasetConfig
from workers.data import check_size, declared, describe, hold_out, load_dataset
from workers.dp.randomness import SecureStream


def load(source, num_classes=None, **options):
    return load_dataset(DatasetConfig(source=source, options=options, num_classes=num_classes))


def test_digits():
    d = load("builtin:digits")
    assert d.size + len(d.y_val) == 1797 and d.num_classes == 10
    assert d.input_shape == (1, 8, 8) and float(d.x.max()) <= 1.0
    assert d.splits == {"train": "private", "val": "public"}


def test_mnist1d_is_procedural_and_leaves_global_rng_alone():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    d = load("builtin:mnist1d", num_samples=500)
    assert np.random.rand() == expected
    assert d.size == 400 and len(d.y_val) == 100 and d.input_shape == (1, 40)
    assert torch.equal(d.x, load("builtin:mnist1d", num_samples=500).x)


def test_heavy_tail_matches_paper_004_construction():
    d = load("builtin:heavy_tail", dim=3)
    counts = torch.bincount(d.y)
    assert d.size == 8192 and d.num_classes == 255 and len(counts) == 255
    assert counts[0] == 1024 and counts[1:3].tolist() == [512, 512] and counts[-1] == 8
    assert d.splits == {"train": "private"}
    assert d.class_group.tolist()[:4] == [0, 1, 1, 2] and len(d.class_group) == 255
    small = load("builtin:heavy_tail", scale=0.25)
    assert small.size == 2048 and small.input_shape == (256 + 2048,)
    assert float(small.x.min()) >= 0 and float(small.x.max()) <= 1


def test_npz_with_public_validation(tmp_path):
    path = tmp_path / "mine.npz"
    np.savez(
        path,
        x=np.zeros((6, 3)),
        y=np.array([0, 1, 2, 0, 1, 1]),
        x_val=np.ones((2, 3)),
        y_val=np.array([3, 0]),
    )
    d = load(f"npz:{path}", num_classes=4)
    assert d.num_classes == 4 and d.splits == {"train": "private", "val": "public"}
    info = describe("npz:mine.npz", tmp_path, num_classes=5)  # declared, not read off labels
    assert (info.n, info.num_classes, info.input_shape, info.public_validation) == (
        6,
        5,
        (3,),
        True,
    )
    np.savez(path, x=np.zeros((6, 3)), y=np.array([0, 1, 2, 0, 1, 1]))
    assert load(f"npz:{path}", num_classes=3).splits == {"train": "private"}
    assert not describe("npz:mine.npz", tmp_path, num_classes=3).public_validation
    assert describe("builtin:digits").n == 1438


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((2, 3))}, "no array 'y'"),
        ({"x": np.zeros((2, 3)), "y": np.array([0.5, 1.0])}, "integer labels"),
        ({"x": np.zeros((2, 3)), "y": np.array([0, 1]), "x_val": np.zeros((1, 3))}, "both"),
    ],
)
def test_npz_errors(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=f"dataset.source.*{message}"):
        load(f"npz:{path}", num_classes=2)


def test_option_errors_name_the_option():
    with pytest.raises(ValueError, match=r"dataset.options.scale"):
        load("builtin:digits", scale=0.5)
    with pytest.raises(ValueError, match=r"dataset.options.groups"):
        load("builtin:heavy_tail", groups=0)
    with pytest.raises(ValueError, match=r"dataset.source"):
        load("npz:/nonexistent.npz")


def test_hold_out_makes_a_private_validation_split():
    full = load("builtin:digits")
    d = hold_out(full, 0.25, SecureStream())
    assert d.splits == {"train": "private", "val": "private"}
    assert d.size + len(d.y_val) == full.size
    assert abs(len(d.y_val) - 0.25 * full.size) < 5 * (0.25 * 0.75 * full.size) ** 0.5


def _table(n=6):
    return pd.DataFrame(
        {
            "a": np.linspace(-1, 1, n),
            "b": np.arange(n) * 0.5,
            "label": np.arange(n) % 3,
            "c": np.ones(n),
        }
    )


def test_csv_and_parquet_tables_load_alike(tmp_path):
    frame = _table()
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet", index=False)
    options = {"label": "label"}
    csv = load_dataset(DatasetConfig(source="csv:t.csv", options=options, num_classes=3), tmp_path)
    pq = describe("parquet:t.parquet", tmp_path, options, num_classes=3)
    assert csv.input_shape == (3,) and csv.splits == {"train": "private"}  # a, b, c: no label
    assert torch.equal(csv.x[:, 1], torch.tensor(frame["b"].to_numpy(), dtype=torch.float32))
    assert csv.y.tolist() == [0, 1, 2, 0, 1, 2]
    assert describe("csv:t.csv", tmp_path, options, num_classes=3) == pq  # same data, same hash
    chosen = load(f"csv:{tmp_path / 't.csv'}", 3, label="label", features=["c", "a"])
    assert chosen.input_shape == (2,) and torch.equal(chosen.x[:, 1], csv.x[:, 0])


@pytest.mark.parametrize(
    "change, options, message",
    [
        ({}, {"label": "class"}, r"options.label: no column 'class'"),
        ({}, {"label": "label", "features": ["a", "z"]}, r"options.features: no column 'z'"),
        (
            {"b": ["1", "2", "oops", "4", "5", "6"]},
            {},
            r"options.features: column 'b' is not numeric \(x\[2\] is 'oops'\)",
        ),
        ({"label": [0, 1.5, 2, 0, 1, 2]}, {}, r"options.label: .*integer labels \(y\[1\] is 1.5"),
        ({"label": [0, 1, None, 0, 1, 2]}, {}, r"options.label: .*\(y\[2\] is nan"),
        ({"label": [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]}, {}, r"options.label: .*its type is float64"),
        ({"a": [0, 1, 2, None, 4, 5]}, {}, r"source: x\[3\] has a non-finite value"),
        ({"label": [0, 1, 2, 3, 1, 2]}, {}, r"source: y\[3\] = 3 is outside"),
    ],
)
def test_table_errors_name_the_column_and_row(tmp_path, change, options, message):
    frame = _table().assign(**change)
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(ValueError, match=f"^dataset.{message}"):
        load(f"csv:{tmp_path / 't.csv'}", 3, **({"label": "label"} | options))


def test_declarations_are_checked_before_the_file_is_read():
    with pytest.raises(ValueError, match=r"^dataset.options.label: required"):
        declared("csv", {}, 3)
    with pytest.raises(ValueError, match=r"^dataset.options.features:"):
        declared("parquet", {"label": "y", "features": ["a", "y"]}, 3)
    with pytest.raises(ValueError, match=r"^dataset.options.label: unknown"):
        declared("npz", {"label": "y"}, 3)
    with pytest.raises(ValueError, match=r"^dataset.num_classes: required for csv"):
        declared("csv", {"label": "y"}, None)
    assert declared("csv", {"label": "y", "features": ["a"]}, 4) == 4


@pytest.mark.parametrize("kind", ["npz", "csv", "parquet"])
def test_unreadable_files_are_refused(tmp_path, kind):
    path = tmp_path / f"bad.{kind}"
    path.write_bytes(b"PK\x03\x04 \xff\xfe\x00 not a file of any format")
    options = {} if kind == "npz" else {"label": "label"}
    with pytest.raises(ValueError, match=f"^dataset.source: not a readable {kind} file"):
        load(f"{kind}:{path}", 3, **options)
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(ValueError, match=r"single .npy array"):
        load(f"npz:{tmp_path / 'one.npz'}", 3)
    _table(0).to_csv(tmp_path / "empty.csv", index=False)  # a header and no rows
    with pytest.raises(ValueError, match=r"no examples"):
        load(f"csv:{tmp_path / 'empty.csv'}", 3, label="label")


def test_digits_are_scikit_learns_digits() -> None:
    """``builtin:digits`` reads scikit-learn's shipped CSV itself (no import of its datasets
    module): the same 1797 images and labels as ``load_digits``, split 80/20 as before."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    d = load_dataset(DatasetConfig(source="builtin:digits"))
    x = torch.cat([d.x, d.x_val]).double().flatten(1) * 16
    y = torch.cat([d.y, d.y_val])
    assert (d.size, len(d.y_val), d.num_classes) == (1438, 359, 10)
    got = sorted(zip(x.round().long().tolist(), y.tolist(), strict=True))
    expected = sorted(zip(raw.data.astype(int).tolist(), raw.target.tolist(), strict=True))
    assert got == expected


def _npy(shape: tuple[int, ...], version: tuple[int, int], data: bytes = b"") -> bytes:
    """A .npy file whose header declares float64 ``shape``, followed by ``data`` only."""
    text = repr({"descr": "<f8", "fortran_order": False, "shape": shape}).encode() + b"\n"
    length = struct.pack("<H" if version == (1, 0) else "<I", len(text))
    return np.lib.format.MAGIC_PREFIX + bytes(version) + length + text + data


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_an_npy_header_declaring_a_huge_array_is_refused_unread(tmp_path, version) -> None:
    """numpy allocates what the header declares before it reads the data."""
    path = tmp_path / "lie.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", _npy((10**12, 3), version, bytes(64)))
        archive.writestr("y.npy", _npy((2,), (1, 0), bytes(16)))
    with pytest.raises(ValueError, match=r"^dataset.source: the npz file declares 24000000000"):
        check_size("npz", path, 2 * 1024**3)


def test_npz_members_that_are_not_arrays_of_the_dataset_are_never_read(tmp_path) -> None:
    path = tmp_path / "extra.npz"
    np.savez_compressed(path, x=np.ones((4, 2)), y=np.array([0, 1, 0, 1]))
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("junk.npy", bytes(64 * 1024**2))  # a bomb nobody asked for
        archive.writestr("x", b"not the array x")  # np.load would give these bytes for "x"
    check_size("npz", path, 1024)
    assert load(f"npz:{path}", num_classes=2).x.shape == (4, 2)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", _npy((2, 2), (3, 0), bytes(32)))
    with pytest.raises(ValueError, match=r"not a readable npz file.*version"):
        check_size("npz", path, 1024)


def test_a_compressed_csv_is_read_as_text_never_inflated(tmp_path) -> None:
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(_table().to_csv(index=False).encode()))
    with pytest.raises(ValueError, match="not a readable csv file"):
        load(f"csv:{path}", 3, label="label")


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["uint8", "int16", "float32", "float64", "int64"]),
    rows=st.integers(1, 300),
    features=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    compressed=st.booleans(),
)
def test_what_an_npz_declares_bounds_what_it_allocates(
    tmp_path_factory, dtype, rows, features, compressed
) -> None:
    """Under a bound of one byte less than its arrays take once read, a file is refused; and
    a file of zeros that compresses well is refused as a bomb only past ``RATIO_FLOOR``."""
    path = tmp_path_factory.mktemp("npz") / "d.npz"
    x, y = np.zeros((rows, *features), dtype=dtype), np.zeros(rows, dtype=np.int64)
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=y)
    with pytest.raises(ValueError, match="DPTUNE_MAX_DATASET_BYTES"):
        check_size("npz", path, x.nbytes + y.nbytes - 1)
    check_size("npz", path, 2 * (x.nbytes + y.nbytes) + 1024)  # small: compress as it may
    assert load(f"npz:{path}", num_classes=2).size == rows
