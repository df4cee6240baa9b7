"""Fixtures every test directory may use: the PostgreSQL server of the tests.

(Tests run with --import-mode=importlib, so helpers are handed out as fixtures.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import create_engine, make_url


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The URL of a PostgreSQL server whose role may create databases, from
    ``DPTUNE_TEST_POSTGRES_URL`` (``postgresql+psycopg://postgres:postgres@127.0.0.1/postgres``;
    ``.ci/postgres.sh`` sets one up). Unset: the test is skipped, or fails when
    ``DPTUNE_REQUIRE_POSTGRES=1`` (CI). Set but unreachable: it fails."""
    url = os.environ.get("DPTUNE_TEST_POSTGRES_URL")
    if not url:
        reason = "PostgreSQL: set DPTUNE_TEST_POSTGRES_URL (see .ci/postgres.sh)"
        if os.environ.get("DPTUNE_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"DPTUNE_REQUIRE_POSTGRES=1 but no server. {reason}", pytrace=False)
        pytest.skip(reason)
    try:
        engine = create_engine(url)
        with engine.connect():
            pass
        engine.dispose()
    except Exception as err:
        pytest.fail(f"DPTUNE_TEST_POSTGRES_URL: cannot connect: {err}", pytrace=False)
    return url


@pytest.fixture
def postgres_database(postgres_server) -> Iterator[Callable[[], str]]:
    """Creates fresh databases on the test server (``make()`` returns a URL) and drops them
    after the test, whoever is still connected."""
    admin = create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    names: list[str] = []

    def make() -> str:
        name = f"dptune_test_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        names.append(name)
        return make_url(postgres_server).set(database=name).render_as_string(hide_password=False)

    yield make
    with admin.connect() as conn:
        for name in names:
            conn.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
    admin.dispose()


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="session")
def bench() -> Callable[[str], ModuleType]:
    """``bench("heavy_tail")`` imports ``bench/heavy_tail.py`` (the benchmarks are scripts, not
    a package), once per session, so that its CI-sized test runs the benchmark's own code."""

    def load(name: str) -> ModuleType:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """A 2-core machine shared with other jobs runs small steps faster on one torch thread
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FilterEpsilon = Callable[..., float]


@pytest.fixture(scope="session")
def filter_epsilon() -> FilterEpsilon:
    """``filter_epsilon(budget, delta, curve, pair_epsilon=0, pair_delta=0)``: a dataset's ε of a
    total under its privacy filter, recomputed with dp-accounting's conversion at the dataset's
    one order (``core.accounting.filter``; ``curve`` None: no curve)."""
    import math

    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    from core.accounting import ORDERS, PAIR_DELTA_SHARE, filter_order

    def spent(
        budget: float,
        delta: float,
        curve: np.ndarray | None,
        pair_epsilon: float = 0.0,
        pair_delta: float = 0.0,
    ) -> float:
        if pair_delta > PAIR_DELTA_SHARE * delta:
            return math.inf
        if curve is None or not np.any(curve):
            return pair_epsilon
        order = filter_order(budget, delta)
        [i] = np.flatnonzero(order == ORDERS)
        at, _ = rdp_lib.compute_epsilon([order], [curve[i]], (1 - PAIR_DELTA_SHARE) * delta)
        return float(at) + pair_epsilon

    return spent
