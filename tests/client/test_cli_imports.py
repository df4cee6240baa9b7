"""``dptune --help`` answers at once: the command line imports torch (the engine) only inside
the commands that train (``audit``), and FastAPI, SQLAlchemy and Ray only for the commands
that run the service (:data:`service.cli.HEAVY`)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from service.cli import HEAVY, app, load

HEAVY_MODULES = {"torch", "workers", "runner", "ray", "sqlalchemy", "fastapi", "uvicorn"}


@pytest.mark.parametrize(
    "args",
    [["--help"], ["jobs", "--help"], ["keys", "create", "--help"], ["budget", "--help"]],
)
def test_help_imports_no_heavy_module(args: list[str]) -> None:
    code = (
        "import sys\n"
        "from service.cli import app\n"
        "try:\n"
        f"    app({args!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY_MODULES!r}))\n"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    elapsed = time.monotonic() - start
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert elapsed < 3, elapsed  # ~0.6 s; generous for a loaded machine


@pytest.mark.parametrize("name", sorted(HEAVY))
def test_a_heavy_command_is_listed_by_its_own_summary(name: str) -> None:
    """The summary in ``dptune --help`` begins the command's own help, which its ``--help``
    shows once loaded."""
    summary = HEAVY[name][2]
    assert " ".join((load(name).help or "").split()).startswith(summary.rstrip("."))
    listed = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert summary in listed.stdout
    assert CliRunner().invoke(app, [name, "--help"]).exit_code == 0
