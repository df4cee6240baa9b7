"""Issue 39, finding 10: a 0.2-MB npz (a zip bomb) grew the control plane by 559 MB and was
registered. A dataset file is now refused — a 422 naming ``source`` (``body`` for an upload),
nothing registered — when the data it declares would take more than
``DPTUNE_MAX_DATASET_BYTES`` once read, or over ``workers.data.MAX_RATIO`` times the file's
size, and it is refused before any of its data is inflated: the tests count what zipfile
inflates, and that pandas never reads a refused table."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core.config import DatasetConfig
from service.api.datasets import UPLOADS
from workers.data import load_dataset

MIB = 1024**2
#: float32 zeros of ``COLUMNS`` columns: 256 rows per MiB
COLUMNS = 1024


def _deflated_zeros(prefix: bytes, mib: int) -> bytes:
    """``prefix`` and ``mib`` MiB of zeros, deflated without compressing them all: after a full
    flush deflate starts afresh, so every MiB of zeros comes out as the same bytes."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(bytes(MIB)) + deflate.flush(zlib.Z_FULL_FLUSH)
    assert deflate.compress(bytes(MIB)) + deflate.flush(zlib.Z_FULL_FLUSH) == block
    return head + block * mib + deflate.flush()


def _crc_of_zeros(prefix: bytes, mib: int) -> int:
    crc, zeros = zlib.crc32(prefix), bytes(MIB)
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return crc


def _member(name: str, data: bytes, crc: int, size: int, offset: int) -> tuple[bytes, bytes]:
    """A deflated zip member's local header and data, and its central directory entry."""
    fields = (20, 0, 8, 0, 0x21, crc, len(data), size, len(name))
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, *fields, 0) + name.encode() + data
    central = struct.pack("<IH", 0x02014B50, 20) + struct.pack(
        "<HHHHHIIIHHHHHII", *fields, 0, 0, 0, 0, 0, offset
    )
    return local, central + name.encode()


def zip_bomb(mib: int) -> bytes:
    """An npz of ``x``: float32 zeros of ``mib`` MiB, and as many zero labels ``y``: a real
    archive (numpy reads it back) of about a thousandth of its data's size."""
    rows = 256 * mib
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (rows, COLUMNS)}
    )
    labels = io.BytesIO()
    np.lib.format.write_array(labels, np.zeros(rows, dtype=np.int64))
    members = [
        (
            "x.npy",
            _deflated_zeros(header.getvalue(), mib),
            _crc_of_zeros(header.getvalue(), mib),
            len(header.getvalue()) + mib * MIB,
        ),
        (
            "y.npy",
            zlib.compress(labels.getvalue(), 9)[2:-4],
            zlib.crc32(labels.getvalue()),
            len(labels.getvalue()),
        ),
    ]
    body, directory = b"", b""
    for name, data, crc, size in members:
        local, central = _member(name, data, crc, size, len(body))
        body, directory = body + local, directory + central
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 2, 2, len(directory), len(body), 0)
    return body + directory + end


@pytest.fixture
def inflated(monkeypatch) -> list[int]:
    """The sizes of what zipfile inflates, read by read."""
    sizes: list[int] = []
    read = zipfile.ZipExtFile.read

    def counted(self, n=-1):
        data = read(self, n)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counted)
    return sizes


@pytest.fixture
def tables_read(monkeypatch) -> list[str]:
    """The tables pandas reads."""
    read: list[str] = []
    for kind in ("csv", "parquet"):
        reader = getattr(pd, f"read_{kind}")
        monkeypatch.setattr(
            pd, f"read_{kind}", lambda *a, _r=reader, _k=kind, **k: read.append(_k) or _r(*a, **k)
        )
    return read


def test_the_bomb_is_a_real_npz(tmp_path) -> None:
    """Read without a bound (as a trial reads a registered file), it inflates to its zeros."""
    path = tmp_path / "small.npz"
    path.write_bytes(zip_bomb(2))
    data = load_dataset(DatasetConfig(source=f"npz:{path}", num_classes=2))
    assert data.x.shape == (512, COLUMNS) and not data.x.any() and not data.y.any()
    assert path.stat().st_size < 8 * 1024


def _post(api, name: str, source: str, **extra):
    body = {"name": name, "source": source, "epsilon": 4.0, "delta": 1e-5, "num_classes": 2}
    return api.client.post("/v1/datasets", headers=api.operator, json=body | extra)


def _registered(api) -> list[str]:
    return [d["name"] for d in api.client.get("/v1/datasets", headers=api.operator).json()]


def test_a_zip_bomb_is_refused_before_it_is_inflated(api, settings, inflated) -> None:
    """400 MiB of zeros in a file of 0.4 MB, under the default bound (2 GiB)."""
    before = _registered(api)
    (settings.data_path / "bomb.npz").write_bytes(zip_bomb(400))
    r = _post(api, "bomb", "npz:bomb.npz")
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    assert error["field"] == "source" and "decompression bomb" in error["message"], error
    assert sum(inflated) < 64 * 1024  # the two .npy headers, not the data
    assert _registered(api) == before


def _table(rows: int, value: float = 0.0) -> pd.DataFrame:
    return pd.DataFrame({"a": np.full(rows, value), "label": np.zeros(rows, dtype=np.int64)})


def _write(path: Path, kind: str, frame: pd.DataFrame) -> None:
    if kind == "npz":
        np.savez(path, x=frame[["a"]].to_numpy(np.float32), y=frame["label"].to_numpy())
    elif kind == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)


@pytest.mark.parametrize("kind", ["npz", "csv", "parquet"])
def test_a_file_over_the_bound_is_refused_unread(
    api, settings, kind, inflated, tables_read
) -> None:
    """Files of 20,000 rows, stored plainly, under a bound of 64 KiB."""
    settings.max_dataset_bytes = 64 * 1024
    _write(settings.data_path / f"big.{kind}", kind, _table(20_000, value=0.123456789))
    options = {} if kind == "npz" else {"options": {"label": "label"}}
    r = _post(api, "big", f"{kind}:big.{kind}", **options)
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    assert error["field"] == "source" and "DPTUNE_MAX_DATASET_BYTES" in error["message"], error
    assert sum(inflated) < 1024 and tables_read == []
    settings.max_dataset_bytes = 2 * 1024**3
    assert _post(api, "big", f"{kind}:big.{kind}", **options).status_code == 201


def test_a_run_length_encoded_parquet_bomb_is_refused_unread(api, settings, tables_read) -> None:
    """A column of 4 million zeros takes a few kB in Parquet and 32 MB in pandas."""
    _table(4_000_000).to_parquet(settings.data_path / "bomb.parquet", index=False)
    r = _post(api, "bomb", "parquet:bomb.parquet", options={"label": "label"})
    assert r.status_code == 422 and "decompression bomb" in r.text, r.text
    assert tables_read == []


def test_an_uploaded_bomb_is_refused_and_nothing_kept(api, settings, inflated) -> None:
    body = {
        "name": "up",
        "source": "upload",
        "format": "npz",
        "num_classes": 2,
        "epsilon": 4.0,
        "delta": 1e-5,
    }
    dataset = api.client.post("/v1/datasets", headers=api.operator, json=body).json()["id"]
    r = api.client.put(f"/v1/datasets/{dataset}/data", headers=api.operator, content=zip_bomb(400))
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "body" and "decompression bomb" in r.text
    assert sum(inflated) < 64 * 1024
    seen = api.client.get(f"/v1/datasets/{dataset}", headers=api.operator).json()
    assert seen["awaiting_data"] and seen["n"] == 0
    assert sorted(p.name for p in (settings.data_path / UPLOADS).iterdir()) == []
