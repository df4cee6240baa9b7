"""Jobs naming their own model by import path: the operator's allow-list, the inspection at
admission (a refusal is a 422 naming the field, nothing reserved) and its report in the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.settings import Settings

PACKAGE = Path(__file__).resolve().parents[1] / "models_pkg"
CNN = "dptune_test_models:group_norm_cnn"


@pytest.fixture(autouse=True)
def allow_test_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator installed ``dptune_test_models`` and allow-listed it (read by the
    ``settings`` fixture from the environment, as ``dptune serve`` reads it)."""
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.setenv("DPTUNE_MODEL_IMPORTS", '["dptune_test_models"]')


def own_spec(spec, dataset: int, name: str = CNN, **options: Any) -> dict[str, Any]:
    body = spec(dataset)
    body["model"] = {"name": name, "options": options}
    return body


def unchanged(api, dataset: int) -> tuple[list, list]:
    return api.budget(dataset)["entries"], api.client.get("/v1/jobs", headers=api.operator).json()


def test_the_setting_is_a_json_list_and_empty_by_default(monkeypatch) -> None:
    assert Settings().model_imports == ["dptune_test_models"]
    monkeypatch.delenv("DPTUNE_MODEL_IMPORTS")
    assert Settings().model_imports == []
    monkeypatch.setenv("DPTUNE_MODEL_IMPORTS", '["pkg.models", "not a module"]')
    with pytest.raises(ValueError, match="model_imports"):
        Settings()


def test_plan_and_job_carry_the_model_report(api, dataset, ana, spec) -> None:
    body = own_spec(spec, dataset["id"], width=4)
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    model = r.json()["model"]
    assert model["input_shape"] == [1, 8, 8] and model["num_classes"] == 10
    assert model["per_sample"] == "fast" and model["refused"] == [] and model["general"] == []
    assert [(m["module"], m["type"]) for m in model["fast"]] == [
        ("0", "Conv2d"),
        ("1", "GroupNorm"),
        ("5", "Linear"),
    ]
    assert model["trainable"] == model["parameters"] == 40 + 8 + 650

    r = api.client.post("/v1/jobs", headers=ana, json=body)
    assert r.status_code == 202, r.text
    assert r.json()["plan"]["model"] == model  # stored for the driver's second inspection
    assert (
        api.client.post("/v1/plans", headers=ana, json=spec(dataset["id"])).json()["model"] is None
    )


@pytest.mark.parametrize(
    ("name", "options", "field", "reason"),
    [
        ("dptune_test_models:batch_norm_cnn", {}, "model.name", "BatchNorm normalises"),
        ("dptune_test_models:dropout_mlp", {}, "model.name", "dropout makes"),
        ("dptune_test_models:wrong_output", {}, "model.name", "expected logits [4, 10]"),
        ("dptune_test_models:shared_positions", {}, "model.name", "per-sample batch"),
        ("dptune_test_models:getpid", {}, "model.name", "defines no factory 'getpid'"),
        ("dptune_test_models:not_a_module", {}, "model.name", "not a torch.nn.Module"),
        ("dptune_test_models.sub:build", {}, "model.name", "cannot import"),
        (CNN, {"depth": 2}, "model.options", "unexpected keyword argument 'depth'"),
        (CNN, {"num_classes": 2}, "model.options.num_classes", "the engine passes it"),
        ("dptune_test_modelsx:build", {}, "model.name", "DPTUNE_MODEL_IMPORTS"),
        ("os:getcwd", {}, "model.name", "not among the modules"),
    ],
)
def test_refused_models_reserve_nothing(
    api, dataset, ana, spec, name, options, field, reason
) -> None:
    before = unchanged(api, dataset["id"])
    body = own_spec(spec, dataset["id"], name, **options)
    for endpoint in ("/v1/plans", "/v1/jobs"):
        r = api.client.post(endpoint, headers=ana, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["errors"][0]
        assert error["field"] == field and reason in error["message"], error
    assert unchanged(api, dataset["id"]) == before


def test_the_allow_list_binds_operators_too(api, dataset, spec, settings) -> None:
    settings.model_imports = []  # the default: built-in models only
    before = unchanged(api, dataset["id"])
    r = api.client.post("/v1/jobs", headers=api.operator, json=own_spec(spec, dataset["id"]))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "model.name", r.text
    assert unchanged(api, dataset["id"]) == before


def test_general_path_is_inspected_as_asked(api, dataset, ana, spec) -> None:
    """A layer fed the whole batch is refused on the fast path, accepted on the general one."""
    body = own_spec(spec, dataset["id"], "dptune_test_models:shared_positions")
    body["method"]["per_sample"] = "general"
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    model = r.json()["model"]
    assert model["per_sample"] == "general" and model["fast"] == []
    assert {m["module"] for m in model["general"]} == {"embed", "position", "head"}
