"""Jobs that name their own model by import path (``"model": {"name": "pkg.models:build"}``).

A job's model is code that runs on the cluster, so a job may name only a factory in a module the
operator allow-lists (``Settings.model_imports``, module prefixes: ``pkg`` allows ``pkg.models``
but not ``pkgx``); the rule is the same for every caller, operators included. Admission then
builds the model here and inspects it (``workers.models.inspect``) before anything is reserved:
a refusal is a 422 naming ``model.name`` (or ``model.options``) with its reason, and an accepted
model's report is part of the plan (``plan.model``). The job's driver inspects the model again
on the workers before any trial, where the package may differ (``runner.driver``).

The package must therefore be importable here as well as on the Ray nodes. Deferring the check
to the workers would cost an analyst more than a late error: a random-stopping job is charged
its whole bound once its Ray job runs, before its driver could refuse the model.
"""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy.orm import Session

from core.config import ModelReport
from core.spec import JobSpec
from service.db import Dataset
from service.planning import PlanError, PlannedJob, plan_job
from service.settings import Settings


def allowed(module: str, prefixes: list[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one (whole dotted components)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def inspect(spec: JobSpec, dataset: Dataset, settings: Settings) -> ModelReport | None:
    """The report of the job's imported model (None for a built-in one); PlanError unless the
    factory is allow-listed, importable here, and its model passes the inspection."""
    factory = spec.model.factory
    if factory is None:
        return None
    if not allowed(factory[0], settings.model_imports):
        raise PlanError(
            "model.name",
            f"module {factory[0]!r} is not among the modules whose models jobs may name "
            "(the operator's DPTUNE_MODEL_IMPORTS)",
        )
    from workers.models import build_model, inspect_model  # loads torch: imported models only

    shape, classes = tuple(dataset.input_shape), dataset.num_classes
    try:
        model = build_model(spec.model, shape, classes)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise PlanError(field, message) from None
    report = inspect_model(model, shape, classes, spec.method.per_sample)
    if report.refused:
        raise PlanError("model.name", f"DP-SGD cannot train this model: {report.reason}")
    return report


def plan_with_model(
    spec: JobSpec, dataset: Dataset, session: Session, settings: Settings
) -> PlannedJob:
    """:func:`service.planning.plan_job`, with the inspection of an imported model."""
    planned = plan_job(spec, dataset, session)
    report = inspect(spec, dataset, settings)
    return replace(planned, plan=planned.plan.model_copy(update={"model": report}))
