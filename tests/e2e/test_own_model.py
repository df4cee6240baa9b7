"""A job with the operator's own model (``tests/models_pkg``, on the Ray head's PYTHONPATH):
inspected at admission, trained on Ray, released; and refused on the workers, where the
package differs, before any attempt: the job fails and nothing is charged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.config import DatasetConfig, ModelConfig
from workers.data import load_dataset
from workers.metrics import evaluate
from workers.models import build_model

from .conftest import OPERATOR, small_job
from .test_jobs import spent_on

PACKAGE = Path(__file__).resolve().parents[1] / "models_pkg"


@pytest.fixture(autouse=True)
def allow_test_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed where the control plane runs (this process) and allow-listed; set before the
    ``service`` fixture reads its settings."""
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.setenv("DPTUNE_MODEL_IMPORTS", '["dptune_test_models"]')


def own_job(dataset: int, name: str, **options: object) -> dict:
    """One trial of the model (an rdp job, which charges what ran)."""
    spec = small_job(dataset)
    spec["model"] = {"name": f"dptune_test_models:{name}", "options": options}
    spec["search_space"] = {}
    return spec


def test_own_model_trains_on_ray_and_is_released(service, digits, tmp_path) -> None:
    job = service.post("/v1/jobs", own_job(digits, "group_norm_cnn", width=4))
    report = job["plan"]["model"]
    assert report["refused"] == [] and [m["type"] for m in report["fast"]] == [
        "Conv2d",
        "GroupNorm",
        "Linear",
    ]
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]
    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    assert [(t["status"], len(t["attempts"])) for t in trials] == [("succeeded", 1)]
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert budget["spent"] == pytest.approx(spent_on(job["plan"], 1), rel=1e-9)

    path = tmp_path / "model.safetensors"
    path.write_bytes(service.client.get(f"/v1/jobs/{job['id']}/model", headers=OPERATOR).content)
    with safe_open(str(path), "pt") as f:
        config = json.loads(f.metadata()["config"])
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert config["model"] == {"name": "dptune_test_models:group_norm_cnn", "options": {"width": 4}}
    data = load_dataset(DatasetConfig(source="builtin:digits"))
    model = build_model(ModelConfig.model_validate(config["model"]), data.input_shape, 10)
    model.load_state_dict(weights)
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]
    with torch.no_grad():
        accuracy = evaluate(model, data.x_val, data.y_val).accuracy
    assert accuracy == pytest.approx(trials[0]["score"], abs=1e-6)  # the released model


def test_model_refused_on_the_workers_fails_the_job_and_charges_nothing(service, digits) -> None:
    """``skewed`` builds a GroupNorm CNN in this process (the control plane admits it) and a
    BatchNorm one anywhere else: the driver's inspection refuses it before any trial."""
    job = service.post("/v1/jobs", own_job(digits, "skewed", planner_pid=os.getpid()))
    assert job["plan"]["model"]["refused"] == []
    done = service.wait(job["id"])
    assert done["status"] == "failed", service.orchestrator.logs(job["id"])[-5000:]
    assert "BatchNorm" in done["error"] and done["error"].startswith("model.name: ")
    assert service.get(f"/v1/jobs/{job['id']}/trials") == []
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert [e["kind"] for e in budget["entries"]] == ["reservation", "release"]
    assert budget["spent"] == 0.0 and budget["reserved"] == pytest.approx(0.0, abs=1e-12)
