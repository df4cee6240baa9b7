"""Database: typed models, engine set-up, migrations and the budget lock."""

from service.db.engine import begin_write, create_db_engine, locked_dataset, upgrade
from service.db.models import (
    ApiKey,
    Artifact,
    Base,
    Dataset,
    Job,
    LedgerEntry,
    Trial,
    TrialAttempt,
)

__all__ = [
    "ApiKey",
    "Artifact",
    "Base",
    "Dataset",
    "Job",
    "LedgerEntry",
    "Trial",
    "TrialAttempt",
    "begin_write",
    "create_db_engine",
    "locked_dataset",
    "upgrade",
]
