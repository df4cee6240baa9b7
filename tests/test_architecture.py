"""The four parts and what each may import (CONTRIBUTING.md, "Layout").

- ``core``: the shared contract and the privacy arithmetic — no torch, Ray or database.
- ``workers`` (the engine): torch only — nothing from the service or the runner, no Ray, no
  database.
- ``runner``: the Ray driver and trainable; nothing imports it but its own entrypoint.
- ``service`` (the control plane): never imports the runner; its planning is pure (no torch).

Checked on the source (every ``import`` statement, wherever it stands), so a lazy import inside
a function counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("core", "workers", "runner", "service")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(part: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): _imports(p) for p in (ROOT / part).rglob("*.py")}


def _offending(part: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in _modules(part).items()
        for name in names
        if name.split(".")[0] in forbidden
    )


@pytest.mark.parametrize(
    ("part", "forbidden"),
    [
        (
            "core",
            ("torch", "ray", "sqlalchemy", "alembic", "fastapi", "service", "workers", "runner"),
        ),
        ("workers", ("ray", "sqlalchemy", "alembic", "fastapi", "service", "runner")),
        ("service", ("runner", "ray.tune")),
        # the client: an analyst installs it without the engine, Ray or the service
        (
            "dptune",
            ("torch", "ray", "sqlalchemy", "alembic", "fastapi", "service", "workers", "runner"),
        ),
    ],
)
def test_part_imports_only_what_it_may(part: str, forbidden: tuple[str, ...]) -> None:
    assert _offending(part, forbidden) == []


def test_nothing_imports_the_runner() -> None:
    """Only ``python -m runner`` (on a Ray node) starts it; the control plane names it in the
    Ray job's entrypoint string and imports nothing of it."""
    for part in ("core", "workers", "service"):
        assert _offending(part, ("runner",)) == []


def test_planning_is_pure() -> None:
    """Planning a job (and so admission) needs no torch: the control plane plans without the
    engine's heavy dependencies."""
    assert not {
        n
        for n in _imports(ROOT / "service" / "planning.py")
        if n.split(".")[0] in ("torch", "workers")
    }


def test_every_part_exists() -> None:
    assert all((ROOT / part / "__init__.py").exists() for part in PARTS)


def test_the_driver_imports_no_torch() -> None:
    """Every job's start waits for its driver's imports before the first trial process is
    asked for: the driver (``python -m runner``) must not import torch or the engine, which
    took 2–3 s of them. Trial processes import them (``runner.job.run``), and the driver only
    to inspect an imported model. Checked in a fresh interpreter, on what the import loads."""
    code = (
        "import sys, runner.driver; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'workers', 'safetensors'}"
        "))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"
