"""One contract: the service answers the models of :mod:`core.views` and the client reads
them (``dptune.models`` subclasses each, allowing fields a newer service adds). What the
client reads of a real service's answer it gives back unchanged, its job's plan typed."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from core import views
from core.plan import Plan
from dptune import models
from service.api import create_app, datasets, jobs, keys, logs, plans
from service.api.server import BackgroundServer, free_port
from service.settings import Settings

KEY = "dpt_views-operator-key-0123456789"
#: client view → the service's response model it reads
CLIENT = {
    models.Progress: views.Progress,
    models.JobView: views.JobOut,
    models.Trial: views.TrialOut,
    models.Entry: views.EntryOut,
    models.Budget: views.BudgetOut,
    models.Dataset: views.DatasetOut,
    models.Plan: views.PlanOut,
    models.Key: views.KeyOut,
    models.NewKey: views.NewKeyOut,
    models.Logs: views.LogOut,
}
ROUTES = [r for m in (jobs, datasets, keys, logs, plans) for r in m.router.routes]
#: privacy parameters of the jobs whose answers are read: each accounting, and a search over
#: batch sizes (a plan with several shapes and no single q, T, σ)
JOBS = {
    "rdp": ({"accounting": "rdp", "epsilon": 1.0}, {"grid": [0.05, 0.2]}, {}),
    "lt": ({"accounting": "lt", "epsilon": 1.8, "expected_trials": 3, "delta": 2e-7}, None, {}),
    "ps": ({"accounting": "ps", "epsilon": 2.0, "mean": 3, "eta": 1}, None, {}),
    "shapes": (
        {"accounting": "rdp", "epsilon": 1.0},
        {"grid": [0.05, 0.2]},
        {"batch_size": {"grid": [32, 64]}},
    ),
}


def spec(dataset: int, name: str) -> dict[str, Any]:
    privacy, lr, space = JOBS[name]
    return {
        "dataset": dataset,
        "model": {"name": "mlp"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "validation": {"split": "private", "noise": 20.0},
        "epochs": 1,
        "batch_size": 64,
        "search_space": {"optimizer.lr": lr or {"values": [0.05, 0.2]}, **space},
        "privacy": privacy,
    }


def same(read: Any, answer: Any) -> bool:
    """Equal as JSON text: the same values, keys in the same order."""
    return json.dumps(read) == json.dumps(answer)


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> Iterator[dict[str, tuple[type[BaseModel], Any]]]:
    """What a real service answers (name → (client view, JSON)), to an operator and an
    analyst, for jobs of each kind."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("views"), operator_key=KEY)
    settings.prepare_dirs()
    found: dict[str, tuple[type[BaseModel], Any]] = {}

    def read(
        name: str, view: type[BaseModel], http: httpx.Client, how: str, path: str, body: Any = None
    ) -> Any:
        response = http.request(how, path, json=body)
        assert response.is_success, response.text
        found[name] = (view, response.json())
        return response.json()

    with BackgroundServer(create_app(settings), free_port(), settings) as server:
        op = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"})
        body = {"name": "digits", "source": "builtin:digits", "epsilon": 8.0, "delta": 1e-5}
        dataset = read("dataset", models.Dataset, op, "POST", "/v1/datasets", body)["id"]
        body = {"name": "a", "role": "analyst", "datasets": [dataset]}
        secret = read("new key", models.NewKey, op, "POST", "/v1/keys", body)["secret"]
        found["key"] = (models.Key, op.get("/v1/keys").json()[-1])
        ana = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"})
        callers = {"operator": op, "analyst": ana}
        for name in JOBS:
            read(f"plan {name}", models.Plan, op, "POST", "/v1/plans", spec(dataset, name))
            job = read(
                f"submit {name}", models.JobView, ana, "POST", "/v1/jobs", spec(dataset, name)
            )
            for who, http in callers.items():
                read(f"job {name} to {who}", models.JobView, http, "GET", f"/v1/jobs/{job['id']}")
        read("cancelled", models.JobView, op, "POST", f"/v1/jobs/{job['id']}/cancel")
        read("logs", models.Logs, op, "GET", f"/v1/jobs/{job['id']}/logs")
        for who, http in callers.items():
            read(f"budget to {who}", models.Budget, http, "GET", f"/v1/datasets/{dataset}/budget")
            read(f"dataset to {who}", models.Dataset, http, "GET", f"/v1/datasets/{dataset}")
        yield found


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{sorted(r.methods)[0]} {r.path}")
def test_every_json_answer_is_a_core_view(route) -> None:
    model = route.response_model
    if typing.get_origin(model) is list:
        (model,) = typing.get_args(model)
    if isinstance(model, type) and issubclass(model, BaseModel):
        assert model.__module__ == "core.views", (route.path, model)


@pytest.mark.parametrize(("client", "core"), CLIENT.items(), ids=lambda c: c.__name__)
def test_each_client_view_is_the_services_model(client, core) -> None:
    assert issubclass(client, core)
    assert client.model_config.get("extra") == "allow"
    assert client.model_fields.keys() == core.model_fields.keys()


NAMES = [
    "dataset",
    "new key",
    "key",
    "cancelled",
    "logs",
    *(f"{verb} {n}" for n in JOBS for verb in ("plan", "submit")),
    *(f"job {n} to {w}" for n in JOBS for w in ("operator", "analyst")),
    *(f"{v} to {w}" for v in ("budget", "dataset") for w in ("operator", "analyst")),
]


@pytest.mark.parametrize("name", NAMES)
def test_the_client_gives_back_what_the_service_answered(answers, name) -> None:
    view, answer = answers[name]
    assert same(view.model_validate(answer).model_dump(mode="json"), answer)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith(("job", "submit", "cancel"))])
def test_a_jobs_plan_is_typed(answers, name) -> None:
    assert isinstance(models.JobView.model_validate(answers[name][1]).plan, Plan)


@pytest.mark.parametrize("name", NAMES)
def test_a_newer_services_fields_reach_the_caller(answers, name) -> None:
    view, answer = answers[name]
    newer = {**answer, "added": [1]}
    if "progress" in answer:
        newer["progress"] = {**answer["progress"], "added": 2}
    if "entries" in answer:
        newer["entries"] = [{**e, "added": 3} for e in answer["entries"]]
    read = view.model_validate(newer)
    assert read.model_extra == {"added": [1]} and same(read.model_dump(mode="json"), newer)


def test_the_client_imports_at_once() -> None:
    """Under a second, the typed plan (core.plan and its accountant) included; the best of
    three fresh interpreters, so that a busy machine does not fail it."""
    code = (
        "import time; start = time.perf_counter(); from dptune import Client; "
        "print(time.perf_counter() - start)"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(3)
    ]
    assert min(float(run.stdout) for run in runs) < 1.0
