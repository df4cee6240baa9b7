"""API keys: creation, hashing, lookup, and the bootstrap operator key."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal, cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import ApiKey, Dataset
from service.db.models import api_key_dataset

Role = Literal["operator", "analyst"]
KEY_PREFIX = "dpt_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a snapshot of their key, detached from any DB session."""

    key_id: int
    role: Role
    dataset_ids: frozenset[int]

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"

    def sees_dataset(self, dataset_id: int) -> bool:
        return self.is_operator or dataset_id in self.dataset_ids


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(
    session: Session, name: str, role: Role, datasets: list[Dataset], secret: str | None = None
) -> tuple[ApiKey, str]:
    """Add a key and return it with its secret, which is not stored and cannot be recovered."""
    secret = secret or KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(name=name, role=role, secret_sha256=digest(secret), datasets=datasets)
    session.add(key)
    return key, secret


def authenticate(session: Session, secret: str) -> Principal | None:
    """The caller with this secret, or None. One query (every request makes it): the key and
    its datasets, a row per dataset."""
    scope = api_key_dataset.c
    query = (
        select(ApiKey.id, ApiKey.role, scope.dataset_id)
        .outerjoin(api_key_dataset, scope.api_key_id == ApiKey.id)
        .where(ApiKey.secret_sha256 == digest(secret))
    )
    rows = session.execute(query).all()
    if not rows:
        return None
    datasets = frozenset(row.dataset_id for row in rows if row.dataset_id is not None)
    return Principal(rows[0].id, cast(Role, rows[0].role), datasets)


def bootstrap_operator(session: Session, configured: str | None) -> str | None:
    """Make sure an operator can log in. A configured key is registered if new; with none
    configured and no operator yet, a key is created and returned (to be shown once)."""
    if configured is not None:
        if authenticate(session, configured) is None:
            create_key(session, "bootstrap operator", "operator", [], secret=configured)
            session.commit()
        return None
    if session.execute(select(ApiKey.id).where(ApiKey.role == "operator")).first():
        return None
    _, secret = create_key(session, "bootstrap operator", "operator", [])
    session.commit()
    return secret
