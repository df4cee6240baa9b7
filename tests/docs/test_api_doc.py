"""docs/api.md's table of job spec fields is generated from the spec models' descriptions
(docs/gen_api.py): every field has one, ``/openapi.json`` carries the same, and the table in
the file is what the generator renders now."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from core.spec import JobSpec
from service.api import create_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = JobSpec.model_json_schema()
#: (model, field) for the spec and every model it holds, search-space dimensions included
FIELDS = [("JobSpec", name) for name in SCHEMA["properties"]] + [
    (model, name) for model, schema in SCHEMA["$defs"].items() for name in schema["properties"]
]


@pytest.fixture(scope="module")
def gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("model", "name"), FIELDS)
def test_every_spec_field_has_a_description(model: str, name: str) -> None:
    schema = SCHEMA if model == "JobSpec" else SCHEMA["$defs"][model]
    assert schema["properties"][name].get("description", "").strip(), f"{model}.{name}"


def test_api_md_holds_the_generated_table(gen_api: ModuleType) -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    assert gen_api.render(text) == text, (
        "docs/api.md is stale: run .venv/bin/python docs/gen_api.py"
    )


def test_the_table_has_a_row_per_field(gen_api: ModuleType) -> None:
    rows = gen_api.table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [path for path, _ in described(SCHEMA)]
    assert "`privacy.epsilon` | number | required | (0, 100] |" in "\n".join(rows)


@pytest.mark.parametrize(
    "text", ["no markers", "<!-- end of spec fields -->", "<!-- spec fields: generated"]
)
def test_render_refuses_a_file_without_its_markers(gen_api: ModuleType, text: str) -> None:
    with pytest.raises(ValueError, match="markers"):
        gen_api.render(text)


def test_openapi_carries_the_descriptions(tmp_path: Path) -> None:
    openapi = create_app(Settings(data_dir=tmp_path)).openapi()
    body = openapi["paths"]["/v1/plans"]["post"]["requestBody"]["content"]["application/json"]
    name = body["schema"]["$ref"].rsplit("/", 1)[1]
    components = openapi["components"]["schemas"]
    served = described(components[name], components)
    assert served == described(SCHEMA) and all(text for _, text in served)


def described(
    model: dict[str, Any], definitions: dict[str, Any] | None = None, prefix: str = ""
) -> list[tuple[str, str]]:
    """(dotted path, description) of every field of a spec schema, nested parts included."""
    return list(_walk(model, SCHEMA["$defs"] if definitions is None else definitions, prefix))


def _walk(model: dict[str, Any], definitions: dict[str, Any], prefix: str) -> Iterator[Any]:
    for name, schema in model["properties"].items():
        yield f"{prefix}{name}", schema.get("description")
        for alternative in schema.get("anyOf", [schema]):
            if "$ref" in alternative:
                part = definitions[alternative["$ref"].rsplit("/", 1)[1]]
                yield from _walk(part, definitions, f"{prefix}{name}.")
