"""SQLAlchemy 2.0 models of the control plane.

The schema is owned by the Alembic migrations in ``service/db/migrations``; a test checks that
these models and the migrations agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    event,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}  # noqa: RUF012


class Timestamp(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp, also on SQLite (which stores no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


api_key_dataset = Table(
    "api_key_dataset",
    Base.metadata,
    Column("api_key_id", ForeignKey("api_key.id", ondelete="CASCADE"), primary_key=True),
    Column("dataset_id", ForeignKey("dataset.id", ondelete="CASCADE"), primary_key=True),
)


class ApiKey(Base):
    """A bearer key. Only the SHA-256 of the secret is stored: keys are 256-bit random
    strings, so a fast hash is enough (no password stretching needed) and allows lookup by
    hash."""

    __tablename__ = "api_key"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(16))  # "operator" | "analyst"
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
    #: made by the service at start (``DPTUNE_OPERATOR_KEY``, or the key it printed): a new
    #: ``DPTUNE_OPERATOR_KEY`` revokes it (:func:`service.auth.bootstrap_operator`)
    bootstrap: Mapped[bool] = mapped_column(default=False, server_default=false())
    #: when an operator revoked it: it authenticates no more. The row stays, as the jobs and
    #: ledger rows it made name it.
    revoked_at: Mapped[datetime | None] = mapped_column(Timestamp())
    datasets: Mapped[list[Dataset]] = relationship(secondary=api_key_dataset)


class Dataset(Base):
    """A registered dataset and its lifetime budget. One announced for upload awaits its data
    (``PUT /v1/datasets/{id}/data``) with ``n`` = 0, no shape and no content hash: no job can
    use it. Registered data always has examples (``workers.data.check`` refuses none)."""

    __tablename__ = "dataset"
    #: SQLite would reuse the id of the last dataset deleted; ids are never reused
    __table_args__ = {"sqlite_autoincrement": True}  # noqa: RUF012

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    source: Mapped[str] = mapped_column(String(300))
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)
    n: Mapped[int]
    num_classes: Mapped[int]
    input_shape: Mapped[list[Any]]
    public_validation: Mapped[bool]
    #: public data (the operator's declaration): never trained on privately, only searched on
    #: as a proxy whose best candidate then trains once on a private dataset (invariant 5)
    public: Mapped[bool] = mapped_column(default=False, server_default=false())
    epsilon: Mapped[float] = mapped_column(Float)  # lifetime budget
    delta: Mapped[float] = mapped_column(Float)
    #: SHA-256 of the data at registration: trials refuse data that changed since (the plan's
    #: q = B/N and T were computed from the registered N); empty while awaiting an upload
    content_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
    #: how many ledger rows the dataset has, and how many of them analysts do not see (the
    #: rows with no amount of random-stopping jobs): kept with every row
    #: (:func:`service.ledger.append`), so that a budget read need not count them
    ledger_rows: Mapped[int] = mapped_column(default=0, server_default="0")
    ledger_rows_hidden: Mapped[int] = mapped_column(default=0, server_default="0")

    @property
    def awaiting_data(self) -> bool:
        """Announced for upload, its file not received yet."""
        return self.n == 0


class Job(Base):
    __tablename__ = "job"
    __table_args__ = (UniqueConstraint("owner_key_id", "idempotency_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("dataset.id"), index=True)
    owner_key_id: Mapped[int] = mapped_column(ForeignKey("api_key.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_sha256: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any]]
    accounting: Mapped[str] = mapped_column(String(8))  # "rdp" | "lt" | "ps"
    status: Mapped[str] = mapped_column(String(16), default="queued")
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
    submitted_at: Mapped[datetime | None] = mapped_column(Timestamp())  # handed to the orchestrator
    #: SHA-256 of the job's runner token (service.api.runner), minted at submission
    runner_token_sha256: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime | None] = mapped_column(Timestamp())
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp())

    trials: Mapped[list[Trial]] = relationship(back_populates="job", order_by="Trial.index")
    artifact: Mapped[Artifact | None] = relationship()


class Trial(Base):
    """One hyperparameter candidate of a job. ``metrics`` is a list of
    ``{"name", "value", "epoch", "public"}``: ``public`` marks values an analyst may see
    (computed on public data or through a DP mechanism, docs/design.md, invariant 4)."""

    __tablename__ = "trial"
    __table_args__ = (UniqueConstraint("job_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("job.id"), index=True)
    index: Mapped[int]
    params: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="running")
    steps: Mapped[int] = mapped_column(default=0)  # steps run, summed over attempts
    metrics: Mapped[list[Any]] = mapped_column(default=list)
    score: Mapped[float | None] = mapped_column(Float)  # DP selection score
    thresholds: Mapped[list[Any] | None]  # per-step clipping thresholds of adaptive rules
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)

    job: Mapped[Job] = relationship(back_populates="trials")
    attempts: Mapped[list[TrialAttempt]] = relationship(order_by="TrialAttempt.number")


class TrialAttempt(Base):
    """One execution of a trial. The row is written *before* the attempt reads any data, so
    every attempt that may have touched data is on record and gets charged (invariant 3)."""

    __tablename__ = "trial_attempt"
    __table_args__ = (UniqueConstraint("trial_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trial.id"), index=True)
    number: Mapped[int]
    steps: Mapped[int | None]
    status: Mapped[str] = mapped_column(String(16), default="running")
    #: the Ray node id the attempt ran on (operator-only: where trials ran can tell their count)
    node: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(Timestamp())


class LedgerEntry(Base):
    """Append-only budget ledger (docs/design.md, invariant 7). A row carries an RDP curve over
    ``core.accounting.ORDERS``, an (ε, δ) pair, or both (a Papernot–Steinke job with a cap
    on K: its curve plus the cap's tail probability as (0, δ)), and optionally what it counts as
    on the ledger's second route, the one the dataset's filter counts (``pld_epsilon``,
    ``pld_delta``)."""

    __tablename__ = "ledger_entry"
    #: a dataset's rows in id order: its newest rows (a budget read) and a page after a row
    #: read only the rows they return. An index on ``dataset_id`` alone made PostgreSQL read
    #: and sort all the dataset's rows to return the newest (SQLite's indexes end with the id)
    __table_args__ = (Index("ix_ledger_entry_dataset_id_id", "dataset_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("dataset.id"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("job.id"), index=True)
    reference: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # "reservation" | "charge" | "release"
    rdp: Mapped[list[Any] | None]
    epsilon: Mapped[float] = mapped_column(Float, default=0.0)
    delta: Mapped[float] = mapped_column(Float, default=0.0)
    note: Mapped[str] = mapped_column(String(300), default="")
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
    #: the row's own ε at its dataset's δ, as the ledger shows it (infinite when its δ alone
    #: exceeds the dataset's): fixed when written, so that showing a row does not read its
    #: curve; empty on rows written before revision 0008
    shown_epsilon: Mapped[float | None] = mapped_column(Float)
    #: the row on the ledger's second route, the one the dataset's filter counts: the (ε, δ)
    #: pair it counts as there (its job's own, PLD or privacy-profile statement, or (0, 0) for
    #: a fixed-K job's later attempts); empty: the same as on the first route (``rdp``,
    #: ``epsilon``, ``delta``; every row before 0012)
    pld_epsilon: Mapped[float | None] = mapped_column(Float)
    pld_delta: Mapped[float | None] = mapped_column(Float)


class LedgerTotal(Base):
    """Running sums of a dataset's ledger, written in the transaction of every ledger row, so
    that reading a budget touches one row per open job instead of every ledger row
    (:mod:`service.ledger`). The row with no ``job_id`` holds the sum of the dataset's charge
    rows; a row with a ``job_id`` holds that job's outstanding reservation, and exists only
    while some of it is outstanding. ``amount`` is the ledger vector (RDP orders, ε, δ, on each
    of the ledger's two routes), each part a list of floats whose exact sum it is: sums of
    floats kept exactly, so the cached totals are the all-rows totals to the bit
    (docs/design.md, invariant 7)."""

    __tablename__ = "ledger_total"

    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("dataset.id"), index=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("job.id"), unique=True)
    amount: Mapped[list[Any]]


@event.listens_for(LedgerEntry, "before_update")
@event.listens_for(LedgerEntry, "before_delete")
def _append_only(*_: object) -> None:
    raise RuntimeError("ledger entries are append-only")


class Artifact(Base):
    """The released model of a job (at most one): a safetensors file under DATA_DIR (path
    relative to it) and the trial it came from — the job's selected trial."""

    __tablename__ = "artifact"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("job.id"), unique=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trial.id"))
    path: Mapped[str] = mapped_column(String(300))
    sha256: Mapped[str] = mapped_column(String(64))
    config: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(Timestamp(), default=utcnow)
