"""Jobs naming their own model by import path: the operator's allow-list (exact modules), the
inspection at admission, in a child process without the service's secrets (a refusal is a 422
naming the field, nothing reserved; an exception's text never reaches the analyst), and its
report in the plan."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service import own_models
from service.own_models import ENVIRONMENT, allowed, child_environment
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
        ("dptune_test_models.sub:build", {}, "model.name", "DPTUNE_MODEL_IMPORTS"),
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


# Issue 39, finding 9: admission imported any submodule of an allow-listed package inside the API
# process, which holds the operator key, and showed the analyst the factory's exception text.

SECRETS = {
    "DPTUNE_OPERATOR_KEY": "dpt_operator-key-in-the-environment-0123",
    "DPTUNE_DATABASE_URL": "postgresql://dptune:hunter2-3b1f9c@db.internal/dptune",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY",
}


def allow(settings: Settings, *modules: str) -> None:
    settings.model_imports = ["dptune_test_models", *modules]


def test_the_model_is_built_where_no_secret_is(
    api, dataset, ana, spec, settings, monkeypatch, tmp_path
) -> None:
    """The factory's module, imported and called at admission, finds none of the service's
    secrets in its environment, nor any ``DPTUNE_`` setting."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    allow(settings, "dptune_probe_models")
    record = tmp_path / "seen.json"
    body = own_spec(spec, dataset["id"], "dptune_probe_models:environment", record=str(record))
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    assert "dptune_probe_models" not in sys.modules  # never imported by the API process
    seen = json.loads(record.read_text())
    assert seen["secrets"] == {}
    assert not set(seen["names"]) & set(SECRETS)
    assert not [n for n in seen["names"] if n.startswith("DPTUNE_")]


@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        ("dptune_probe_models:leaky", {}, "RuntimeError"),
        ("dptune_probe_models:leaky", {"kind": "type"}, "TypeError"),
        ("dptune_probe_broken:build", {}, "RuntimeError"),
    ],
)
def test_the_analyst_sees_an_exceptions_type_never_its_text(
    api, dataset, ana, spec, settings, caplog, name, options, error
) -> None:
    """The operator's code may put anything it can read into an exception's message: the 422
    names the exception's type; the operator's log has the message."""
    allow(settings, "dptune_probe_models", "dptune_probe_broken")
    before = unchanged(api, dataset["id"])
    body = own_spec(spec, dataset["id"], name, **options)
    r = api.client.post("/v1/jobs", headers=ana, json=body)  # plans are admitted alike
    assert r.status_code == 422, r.text
    assert "hunter2" not in r.text and "postgresql" not in r.text
    assert r.json()["errors"][0]["field"] == "model.name" and error in r.text
    assert unchanged(api, dataset["id"]) == before
    assert "hunter2-3b1f9c@db.internal" in caplog.text


def _package(root: Path, name: str) -> Path:
    """A package ``name`` with a submodule ``side``, whose import writes a file (returned)."""
    marker = root / f"{name}-side-imported"
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "side.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\n\ndef build(**_):\n    pass\n"
    )
    return marker


@pytest.mark.parametrize(
    ("allowed", "named"),
    [
        (["{pkg}"], "{pkg}.side"),  # a submodule of an allowed package
        (["{pkg}.other"], "{pkg}.side"),  # a sibling of an allowed module
        (["{pkg}.sid"], "{pkg}.side"),
        (["{pkg}.side.deeper"], "{pkg}.side"),  # the parent of an allowed module
    ],
)
def test_only_the_named_module_is_allowed_and_nothing_else_is_imported(
    api, dataset, ana, spec, settings, tmp_path, monkeypatch, allowed, named
) -> None:
    package = f"dptune_probe_pkg_{tmp_path.name}".replace("-", "_")
    marker = _package(tmp_path, package)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings.model_imports = [a.format(pkg=package) for a in allowed]
    r = api.client.post(
        "/v1/plans",
        headers=ana,
        json=own_spec(spec, dataset["id"], f"{named.format(pkg=package)}:build"),
    )
    assert r.status_code == 422 and "DPTUNE_MODEL_IMPORTS" in r.text, r.text
    assert not marker.exists()


dotted = st.lists(
    st.sampled_from(["pkg", "pkgx", "models", "m", "sub"]), min_size=1, max_size=4
).map(".".join)


@given(module=dotted, modules=st.lists(dotted, max_size=4))
def test_a_module_is_allowed_exactly_when_it_is_named(module: str, modules: list[str]) -> None:
    assert allowed(module, modules) == (module in modules)


@given(
    environ=st.dictionaries(
        st.one_of(
            st.sampled_from([*ENVIRONMENT, *SECRETS, "DPTUNE_MODEL_IMPORTS", "PYTHONPATH"]),
            st.text(min_size=1, max_size=8),
        ),
        st.text(max_size=8),
    )
)
def test_the_childs_environment_is_an_allow_list(environ: dict[str, str]) -> None:
    env = child_environment(environ)
    assert set(env) <= {*ENVIRONMENT, "PYTHONPATH"}
    assert all(env[k] == environ[k] for k in env if k != "PYTHONPATH")
    assert env["PYTHONPATH"].split(os.pathsep) == [p for p in sys.path if p]


def test_a_hungry_or_slow_factory_is_refused(
    api, dataset, ana, spec, settings, monkeypatch
) -> None:
    """The child's memory is capped at ``MEMORY_BYTES``, and it is stopped after ``TIMEOUT_S``."""
    allow(settings, "dptune_probe_models")
    monkeypatch.setattr(own_models, "MEMORY_BYTES", 1024**3)
    hungry = own_spec(spec, dataset["id"], "dptune_probe_models:hungry", gib=2.0)
    r = api.client.post("/v1/plans", headers=ana, json=hungry)
    assert r.status_code == 422 and "RuntimeError" in r.text, r.text
    monkeypatch.setattr(own_models, "TIMEOUT_S", 5.0)
    slow = own_spec(spec, dataset["id"], "dptune_probe_models:slow")
    r = api.client.post("/v1/plans", headers=ana, json=slow)
    assert r.status_code == 422 and "took over 5 s" in r.text, r.text
