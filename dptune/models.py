"""Typed views of what the service answers: the service's own response models
(:mod:`core.views`), each allowing fields it does not name (``extra="allow"``) so that a newer
service's additions reach the caller instead of being dropped."""

from __future__ import annotations

from pydantic import ConfigDict

from core import views

#: job states after which nothing changes
FINAL = frozenset({"succeeded", "released", "failed", "cancelled"})

OPEN = ConfigDict(extra="allow")


class Progress(views.Progress):
    """How far a job is (:class:`core.views.Progress`)."""

    model_config = OPEN


class JobView(views.JobOut):
    """A job as the key sees it (``GET /v1/jobs/{id}``); ``plan`` is the typed
    :class:`core.plan.Plan` it was admitted with."""

    model_config = OPEN
    progress: Progress

    @property
    def done(self) -> bool:
        """Whether the job has ended: nothing about it changes any more."""
        return self.status in FINAL


class Trial(views.TrialOut):
    """One trial of a job (``GET /v1/jobs/{id}/trials``)."""

    model_config = OPEN


class Entry(views.EntryOut):
    """A ledger row as the key sees it."""

    model_config = OPEN


class Budget(views.BudgetOut):
    """A dataset's budget and its newest ledger rows (``GET /v1/datasets/{id}/budget``)."""

    model_config = OPEN
    entries: list[Entry]


class Dataset(views.DatasetOut):
    """A dataset (``GET /v1/datasets/{id}``)."""

    model_config = OPEN


class Plan(views.PlanOut):
    """What a job would cost (``POST /v1/plans``)."""

    model_config = OPEN


class Key(views.KeyOut):
    """An API key, without its secret (``GET /v1/keys``)."""

    model_config = OPEN


class NewKey(views.NewKeyOut, Key):
    """A key just created, with its ``secret`` (shown only in this answer)."""

    model_config = OPEN


class Logs(views.LogOut):
    """A page of a job's driver log (``GET /v1/jobs/{id}/logs``)."""

    model_config = OPEN
