"""The dptune client: ``from dptune import Client``. httpx, pydantic and rich, and the typed
views it shares with the service (``core.views``): no torch, Ray, database or service."""

from dptune.client import Client, Job
from dptune.errors import (
    ApiError,
    Conflict,
    DptuneError,
    NotFound,
    Overloaded,
    Refused,
    Unauthorized,
)
from dptune.models import Budget, Dataset, JobView, Key, Logs, NewKey, Plan, Trial

__all__ = [
    "ApiError",
    "Budget",
    "Client",
    "Conflict",
    "Dataset",
    "DptuneError",
    "Job",
    "JobView",
    "Key",
    "Logs",
    "NewKey",
    "NotFound",
    "Overloaded",
    "Plan",
    "Refused",
    "Trial",
    "Unauthorized",
]
