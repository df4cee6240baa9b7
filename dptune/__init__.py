"""The dptune client: ``from dptune import Client``. Only httpx, pydantic and rich."""

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
from dptune.models import Budget, Dataset, JobView, Key, Logs, Plan, Trial

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
    "NotFound",
    "Overloaded",
    "Plan",
    "Refused",
    "Trial",
    "Unauthorized",
]
