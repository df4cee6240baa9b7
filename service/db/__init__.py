"""Database: typed models, engine set-up, the schema (Alembic only) and the budget lock."""

from service.db.engine import begin_write, create_db_engine, locked_dataset
from service.db.models import (
    ApiKey,
    Artifact,
    Base,
    Dataset,
    Job,
    LedgerEntry,
    LedgerTotal,
    Trial,
    TrialAttempt,
)
from service.db.schema import current_revision, ensure_schema, head_revision, upgrade

__all__ = [
    "ApiKey",
    "Artifact",
    "Base",
    "Dataset",
    "Job",
    "LedgerEntry",
    "LedgerTotal",
    "Trial",
    "TrialAttempt",
    "begin_write",
    "create_db_engine",
    "current_revision",
    "ensure_schema",
    "head_revision",
    "locked_dataset",
    "upgrade",
]
