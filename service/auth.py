"""API keys: creation, hashing, lookup, revocation, and the bootstrap operator key."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal, cast

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db import ApiKey, Dataset, begin_write
from service.db.models import api_key_dataset, utcnow
from service.settings import StartupError

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
    """The caller with this secret, or None (also for a revoked key). One query, made by every
    request and cached nowhere, so that a revocation holds from the next request on: the key
    and its datasets, a row per dataset."""
    scope = api_key_dataset.c
    query = (
        select(ApiKey.id, ApiKey.role, scope.dataset_id)
        .outerjoin(api_key_dataset, scope.api_key_id == ApiKey.id)
        .where(ApiKey.secret_sha256 == digest(secret), ApiKey.revoked_at.is_(None))
    )
    rows = session.execute(query).all()
    if not rows:
        return None
    datasets = frozenset(row.dataset_id for row in rows if row.dataset_id is not None)
    return Principal(rows[0].id, cast(Role, rows[0].role), datasets)


class LastOperator(Exception):
    """Revoking the key would leave no operator key: nobody could manage the service until a
    new ``DPTUNE_OPERATOR_KEY`` and a restart."""


def revoke(session: Session, key: ApiKey) -> None:
    """Revoke the key at once (:func:`authenticate` refuses it from the next request on),
    unless it is the last operator key (:class:`LastOperator`). The row stays: jobs and ledger
    rows name it. The caller holds the write transaction (``begin_write``) and the operator
    keys are locked, so that two operators revoking each other's keys cannot both succeed and
    leave none."""
    if key.revoked_at is not None:
        return
    if key.role == "operator" and _operators(session) <= 1:
        raise LastOperator(
            f"key {key.id} is the last operator key: create another operator key first"
        )
    key.revoked_at = utcnow()


def _operators(session: Session) -> int:
    """How many operator keys are valid, their rows locked (PostgreSQL) until the transaction
    ends: a concurrent revocation waits, then counts again."""
    active = select(ApiKey.id).where(ApiKey.role == "operator", ApiKey.revoked_at.is_(None))
    return len(session.execute(active.with_for_update()).all())


def bootstrap_operator(session: Session, configured: str | None) -> str | None:
    """Make sure an operator can log in. A configured key (``DPTUNE_OPERATOR_KEY``) is
    registered if new, and replaces the bootstrap key before it: that one is revoked, so that
    changing the setting and restarting shuts the old key out. A configured key that was
    revoked is refused (a :class:`StartupError`): a revoked key never comes back. With none
    configured and no operator yet, a key is created and returned (to be shown once)."""
    begin_write(session)  # services starting together register the key once
    if configured is not None:
        _configure(session, configured)
        session.commit()
        return None
    if _operators(session):
        session.commit()
        return None
    key, secret = create_key(session, "bootstrap operator", "operator", [])
    key.bootstrap = True
    session.commit()
    return secret


def _configure(session: Session, configured: str) -> None:
    query = select(ApiKey).where(ApiKey.secret_sha256 == digest(configured))
    key = session.execute(query).scalar_one_or_none()
    if key is not None and (key.revoked_at is not None or key.role != "operator"):
        raise StartupError(
            f"DPTUNE_OPERATOR_KEY is key {key.id}, which is revoked or not an operator key: "
            "set DPTUNE_OPERATOR_KEY to a new secret"
        )
    if key is None:
        key, _ = create_key(session, "bootstrap operator", "operator", [], secret=configured)
        session.flush()
    replaced = (ApiKey.bootstrap, ApiKey.revoked_at.is_(None), ApiKey.id != key.id)
    session.execute(update(ApiKey).where(*replaced).values(revoked_at=utcnow()))
    key.bootstrap = True
