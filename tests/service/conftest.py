"""Fixtures: the API on a real database (a SQLite file in tmp_path, and PostgreSQL), keys, a
registered dataset.

(Tests run with --import-mode=importlib, so helpers are handed out as fixtures.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.settings import Settings

OPERATOR_KEY = "dpt_test-operator-key-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Api:
    client: TestClient
    operator: dict[str, str]

    def register(
        self,
        name: str = "digits",
        epsilon: float = 4.0,
        delta: float = 1e-5,
        source: str = "builtin:digits",
        **extra: Any,
    ) -> dict[str, Any]:
        r = self.client.post(
            "/v1/datasets",
            headers=self.operator,
            json={"name": name, "source": source, "epsilon": epsilon, "delta": delta, **extra},
        )
        assert r.status_code == 201, r.text
        return r.json()

    def analyst(self, *datasets: int) -> dict[str, str]:
        r = self.client.post(
            "/v1/keys",
            headers=self.operator,
            json={"name": "ana", "role": "analyst", "datasets": list(datasets)},
        )
        assert r.status_code == 201, r.text
        return bearer(r.json()["secret"])

    def budget(self, dataset: int) -> dict[str, Any]:
        r = self.client.get(f"/v1/datasets/{dataset}/budget", headers=self.operator)
        assert r.status_code == 200, r.text
        return r.json()


def make_spec(dataset: int, epsilon: float = 1.0, **privacy: Any) -> dict[str, Any]:
    """A small rdp job: a grid of 2 learning rates, one epoch, a private validation score."""
    return {
        "dataset": dataset,
        "model": {"name": "mlp"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "validation": {"split": "private", "noise": 20.0},
        "epochs": 1,
        "batch_size": 64,
        "search_space": {"optimizer.lr": {"grid": [0.05, 0.2]}},
        "privacy": {"epsilon": epsilon, "accounting": "rdp", **privacy},
    }


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request) -> str | None:
    """Every test that starts the service runs on both databases: ``sqlite`` (None: the
    default file in the state dir) and ``postgresql`` (a fresh database on the server of
    ``DPTUNE_TEST_POSTGRES_URL``, dropped after the test; skipped without one)."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_database")()


@pytest.fixture
def settings(tmp_path, database_url) -> Settings:
    settings = Settings(data_dir=tmp_path, database_url=database_url, operator_key=OPERATOR_KEY)
    settings.prepare_dirs()  # as the service does before it opens the database
    return settings


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def api(client) -> Api:
    return Api(client, bearer(OPERATOR_KEY))


@pytest.fixture
def spec() -> Callable[..., dict[str, Any]]:
    return make_spec


@pytest.fixture
def dataset(api) -> dict[str, Any]:
    return api.register()


@pytest.fixture
def ana(api, dataset) -> dict[str, str]:
    return api.analyst(dataset["id"])
