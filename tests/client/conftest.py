"""Fixtures: the real API on SQLite, served over HTTP on a free port (jobs are admitted and
charged but never run: no orchestrator), an operator key, a registered dataset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.settings import Settings

OPERATOR_KEY = "dpt_client-operator-key-0123456789"


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    settings = Settings(data_dir=tmp_path, operator_key=OPERATOR_KEY)
    settings.prepare_dirs()
    with BackgroundServer(create_app(settings), free_port(), settings) as server:
        yield server.url


@pytest.fixture
def operator_key() -> str:
    return OPERATOR_KEY


@pytest.fixture
def dataset(url: str) -> int:
    """A dataset with ε = 2 (digits)."""
    body = {"name": "digits", "source": "builtin:digits", "epsilon": 2.0, "delta": 1e-5}
    r = httpx.post(
        f"{url}/v1/datasets", json=body, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


@pytest.fixture
def job_spec():
    def make(dataset: int, epsilon: float = 1.0) -> dict[str, Any]:
        """A small rdp job: two learning rates, one epoch, a private validation score."""
        return {
            "dataset": dataset,
            "model": {"name": "mlp"},
            "method": {"clipping": "abadi", "threshold": 1.0},
            "optimizer": {"name": "sgd", "lr": 0.1},
            "validation": {"split": "private", "noise": 20.0},
            "epochs": 1,
            "batch_size": 64,
            "search_space": {"optimizer.lr": {"grid": [0.05, 0.2]}},
            "privacy": {"epsilon": epsilon, "accounting": "rdp"},
        }

    return make
