"""What makes budget reads fast changes nothing they return. JSON columns read back exactly
what was written: the engine parses them with msgspec (``service.db.engine.json_loads``) for
speed, and the ledger's exact sums need every float back to the bit, so the reads are checked
against the stdlib parser and against the bits written. (Row counts and each row's shown ε:
tests/service/test_ledger_totals.py, test_migrations.py.)"""

from __future__ import annotations

import gc
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import JSON, Column, Integer, MetaData, Table, insert, select

from service.api import create_app
from service.db import create_db_engine
from service.db.engine import json_loads


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def _random_doubles(n: int, seed: int = 0) -> list[float]:
    """Finite doubles from uniform bit patterns (every exponent, subnormals and both zeros),
    plus the extremes."""
    patterns = np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64)
    values = [v for v in patterns.view(np.float64).tolist() if math.isfinite(v)]
    tiny, huge = 5e-324, 1.7976931348623157e308
    return [*values, 0.0, -0.0, tiny, -tiny, huge, -huge, 2.2250738585072014e-308]


def test_every_double_reads_back_to_the_bit() -> None:
    values = _random_doubles(200_000)
    text = json.dumps(values)
    assert _bits(json_loads(text)) == _bits(values)
    assert _bits(json_loads(text)) == _bits(json.loads(text))
    assert _bits(json_loads(text.encode())) == _bits(values)  # psycopg may hand over bytes


@pytest.mark.parametrize(
    "text",
    [
        "[NaN, 1.5]",
        "[Infinity, -Infinity]",
        "1e400",
        '{"seed": 123456789012345678901234567890}',
        "[18446744073709551616, -9223372036854775809, 9223372036854775807]",
    ],
)
def test_what_is_not_strict_json_reads_as_json_reads_it(text: str) -> None:
    """msgspec refuses NaN, Infinity (what ``json.dumps`` writes for them) and a number beyond
    the doubles: those read as the stdlib parser reads them; integers of any size exactly."""
    for raw in (text, text.encode()):
        got = json_loads(raw)
        assert json.dumps(got) == json.dumps(json.loads(text))


def test_a_json_column_round_trips_on_the_database(settings) -> None:
    """Through the real engine and driver (pysqlite, psycopg), which hand the column's text to
    ``json_loads``."""
    engine = create_db_engine(settings.sqlalchemy_url)
    table = Table(
        "json_probe", MetaData(), Column("id", Integer, primary_key=True), Column("v", JSON)
    )
    table.create(engine)
    values = _random_doubles(5_000, seed=1)
    stored: dict[str, Any] = {"curve": values, "big": 2**70 + 1}
    if engine.dialect.name == "sqlite":  # PostgreSQL's json type refuses Infinity
        stored["special"] = [math.inf, -math.inf]
    try:
        with engine.begin() as conn:
            conn.execute(insert(table).values(id=1, v=stored))
        with engine.connect() as conn:
            read = conn.execute(select(table.c.v)).scalar_one()
        assert _bits(read["curve"]) == _bits(values)
        assert read == stored | {"curve": read["curve"]}
    finally:
        table.drop(engine)
        engine.dispose()


def test_the_serving_app_keeps_its_start_up_objects_out_of_collections(settings) -> None:
    """A full collection scanned every object of the started app (~130 ms, the slowest budget
    read of a run): while it serves they are frozen (:func:`gc.freeze`), and given back after."""
    before = gc.get_freeze_count()
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_freeze_count() > before + 10_000
    assert gc.get_freeze_count() == before


LATER_LOADS = """
import gc, sys
from fastapi.testclient import TestClient
from service.api import create_app
from service.settings import Settings

app = create_app(Settings(data_dir=sys.argv[1], operator_key="dpo_" + "k" * 40))
with TestClient(app) as client:
    assert "torch" not in sys.modules
    assert "dp_accounting.pld.privacy_loss_distribution" in sys.modules  # planning's, at start
    body = {"name": "d", "source": "builtin:digits", "epsilon": 1.0, "delta": 1e-5}
    auth = {"Authorization": "Bearer dpo_" + "k" * 40}
    assert client.post("/v1/datasets", json=body, headers=auth).status_code == 201
    import torch

    tracked = {id(o) for o in gc.get_objects()}
    loaded = [torch.nn.Module.__init__, torch.Tensor.backward, torch.optim.SGD.step]
    print(sum(id(f) in tracked for f in loaded))
"""


def test_what_the_app_loads_later_is_kept_out_of_collections_too(tmp_path) -> None:
    """Registering a dataset loads torch (~180,000 objects, in a process that had none), after
    start-up has frozen the app's objects; left to the collector, every full collection after
    scans them (~100 ms a pause on the 2-core machine). They are frozen as they are loaded, and
    planning's PLD code is loaded before the freeze. A fresh interpreter: this one may have
    imported torch before."""
    run = subprocess.run(
        [sys.executable, "-c", LATER_LOADS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "0"
