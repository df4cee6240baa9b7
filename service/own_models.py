"""Jobs that name their own model by import path (``"model": {"name": "pkg.models:build"}``).

A job's model is code that runs on the cluster, so a job may name only a factory in a module the
operator allow-lists (``Settings.model_imports``): the module itself, exactly — ``pkg.models``
allows neither ``pkg.models.extra`` nor ``pkg``, whose code the operator did not name. The rule
is the same for every caller, operators included. Admission then builds the model and inspects
it (``workers.models.inspect``) before anything is reserved: a refusal is a 422 naming
``model.name`` (or ``model.options``) with its reason, and an accepted model's report is part of
the plan (``plan.model``). The job's driver inspects the model again on the workers before any
trial, where the package may differ (``runner.driver``).

The model is built in a child process (:mod:`workers.models.isolated`), not in the API process,
which holds the operator key and the database credentials (docs/design.md, invariant 10): the
child's environment is an allow-list of the service's (:func:`child_environment`), its memory
is capped and its time bounded, and what it answers an analyst names an exception's type, never
its text (the service log has the whole of it). Its answers are kept per request: the module
is the one the service found at its first import, as an import in this process would be.

The package must therefore be importable here as well as on the Ray nodes. Deferring the check
to the workers would cost an analyst more than a late error: a random-stopping job is charged
its whole bound once its Ray job runs, before its driver could refuse the model.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from typing import IO, Any

from sqlalchemy.orm import Session

from core.config import ModelReport
from core.spec import JobSpec
from service.db import Dataset
from service.planning import PlanError, PlannedJob, plan_job
from service.settings import Settings

log = logging.getLogger(__name__)

#: what the child's environment keeps of the service's: where programs, home and temporary
#: files are, the locale, and the thread counts of torch's libraries — no ``DPTUNE_`` setting,
#: no credential (``PYTHONPATH`` is this process's ``sys.path``: the modules it would import)
ENVIRONMENT = (
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
#: seconds a model's build and inspection may take (the child imports torch first)
TIMEOUT_S = 120.0
#: the child's heap and private mappings, in bytes
MEMORY_BYTES = 8 * 1024**3
#: how much of the child's stderr goes to the service log
LOGGED_BYTES = 64 * 1024


def allowed(module: str, modules: list[str]) -> bool:
    """Whether ``module`` is one the operator named (exactly: not a submodule of one)."""
    return module in modules


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: the allow-listed variables of ``environ``, and this process's
    import path."""
    env = {name: environ[name] for name in ENVIRONMENT if name in environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def inspect(spec: JobSpec, dataset: Dataset, settings: Settings) -> ModelReport | None:
    """The report of the job's imported model (None for a built-in one); PlanError unless the
    factory is allow-listed, importable, and its model passes the inspection."""
    factory = spec.model.factory
    if factory is None:
        return None
    if not allowed(factory[0], settings.model_imports):
        raise PlanError(
            "model.name",
            f"module {factory[0]!r} is not among the modules whose models jobs may name "
            "(the operator's DPTUNE_MODEL_IMPORTS)",
        )
    request = {
        "model": spec.model.model_dump(mode="json"),
        "input_shape": list(dataset.input_shape),
        "num_classes": dataset.num_classes,
        "per_sample": spec.method.per_sample,
        "memory_bytes": MEMORY_BYTES,
    }
    report = ModelReport.model_validate_json(_inspected(json.dumps(request, sort_keys=True)))
    if report.refused:
        raise PlanError("model.name", f"DP-SGD cannot train this model: {report.reason}")
    return report


@lru_cache(maxsize=256)
def _inspected(request: str) -> str:
    """The child's report for ``request`` (JSON text); PlanError if the model cannot be built
    or the child gave no answer in time (these are not kept: the operator may fix them)."""
    name = json.loads(request)["model"]["name"]
    with tempfile.TemporaryFile() as stderr:
        try:
            done = subprocess.run(
                [sys.executable, "-P", "-m", "workers.models.isolated"],
                input=request.encode(),
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=child_environment(os.environ),
                timeout=TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            _log(name, f"was stopped after {TIMEOUT_S:g} s", stderr, failed=True)
            raise PlanError(
                "model.name", f"building and inspecting the model took over {TIMEOUT_S:g} s"
            ) from None
        answer = _answer(done.stdout) if done.returncode == 0 else None
        _log(name, f"exited with status {done.returncode}", stderr, failed=answer is None)
    if answer is None:
        raise PlanError(
            "model.name",
            f"building and inspecting the model failed (its process exited with status "
            f"{done.returncode}; the operator's log has the details)",
        )
    if "report" not in answer:
        raise PlanError(answer["field"], answer["message"])
    return json.dumps(answer["report"])


def _answer(stdout: bytes) -> dict[str, Any] | None:
    """The child's answer, if it is one: a report, or a field and a message."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    return answer if set(answer) in ({"report"}, {"field", "message"}) else None


def _log(name: str, outcome: str, stderr: IO[bytes], failed: bool) -> None:
    """The end of what the child wrote to stderr (the operator's tracebacks and prints), for
    the operator, with how it ended when it failed."""
    size = stderr.seek(0, os.SEEK_END)
    if size == 0 and not failed:
        return
    stderr.seek(max(0, size - LOGGED_BYTES))
    text = stderr.read().decode(errors="replace")
    log.warning("inspecting model %s: its process %s; its stderr:\n%s", name, outcome, text)


def plan_with_model(
    spec: JobSpec, dataset: Dataset, session: Session, settings: Settings
) -> PlannedJob:
    """:func:`service.planning.plan_job`, with the inspection of an imported model."""
    planned = plan_job(spec, dataset, session)
    report = inspect(spec, dataset, settings)
    return replace(planned, plan=planned.plan.model_copy(update={"model": report}))
