"""Datasets and their budgets; uploads of their files.

An operator registers a dataset from a builtin, from a file under DATA_DIR (``npz:``,
``csv:``, ``parquet:``), or announces one for upload (``"source": "upload"`` and a
``format``): it awaits its data, no job can use it, until ``PUT /v1/datasets/{id}/data``
streams the file to ``DATA_DIR/uploads/<id>.<format>``. The file is read and checked
(:func:`workers.data.load_dataset`, as every trial reads it) before it is moved into place
and its size and content hash recorded; a file that fails leaves nothing behind. A file whose
data would take more than ``DPTUNE_MAX_DATASET_BYTES`` once read, or that declares over 100
times its size (a decompression bomb), is refused before it is inflated
(:func:`workers.data.check_size`).

An operator deletes a dataset only while nothing was ever charged to it, nor any job made on it
(a mistyped registration): the ledger is append-only (docs/design.md, invariant 7), and a
dataset's budget belongs to its data for good.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import IO, Annotated, Any, Literal, Self

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Select, delete, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from core.spec import MAX_ID, Scalar
from core.views import BudgetOut, DatasetOut, EntryOut, LedgerOut, UploadOut
from service import ledger, visibility
from service.api import heap
from service.api.deps import Caller, Id, Operator, SessionDep, SettingsDep, visible_dataset
from service.api.errors import COMMON, field_error, responses
from service.api.listing import COUNTED, TOTAL, ListQuery, Page, page
from service.db import Dataset, Job, LedgerEntry, begin_write, locked_dataset
from service.db.models import api_key_dataset

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=COMMON)

SOURCE = r"^(builtin:(digits|mnist1d|heavy_tail)|(npz|csv|parquet):[^\x00]{1,250}|upload)$"
#: where uploaded files are kept, under DATA_DIR; file registrations may not point into it
UPLOADS = "uploads"
#: request paths of dataset uploads: their bodies are streamed (service.api.limits)
UPLOAD_PATHS = r"/v1/datasets/\d+/data"
Column = Annotated[str, Field(min_length=1, max_length=200)]


class DatasetIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[\w.-]+$")
    source: str = Field(
        pattern=SOURCE,
        description="builtin:digits, builtin:mnist1d, builtin:heavy_tail, a file under "
        "DATA_DIR (npz:<path>, csv:<path>, parquet:<path>), or upload: the file follows with "
        "PUT /v1/datasets/{id}/data",
    )
    format: Literal["npz", "csv", "parquet"] | None = Field(
        None, description="the file format of an upload (source 'upload' only)"
    )
    options: dict[str, Scalar | list[Column]] = Field(
        default_factory=dict,
        max_length=20,
        description="csv and parquet: label (the label column, required) and features "
        "(the input columns; default: all the others)",
    )
    num_classes: int | None = Field(
        None,
        ge=2,
        le=100_000,
        description="the declared label set {0, …, num_classes − 1}: "
        "required for files (it is public, so it is not read off the private labels); "
        "optional for builtins, which must then match",
    )
    epsilon: float = Field(gt=0, le=100, description="lifetime budget ε")
    delta: float = Field(gt=0, lt=1, description="lifetime budget δ")
    public: bool = Field(
        False,
        description="public data: jobs may tune on it as their `proxy` (free), never train on "
        "it privately; its budget is never charged",
    )

    @model_validator(mode="after")
    def _format_of_uploads(self) -> Self:
        if (self.source == "upload") != (self.format is not None):
            raise ValueError("format: required exactly when source is 'upload'")
        return self


#: how many ledger rows a response lists
Limit = Annotated[int, Query(ge=1, le=1000, description="at most this many ledger rows")]


class LedgerQuery(ListQuery):
    after: int = Field(0, ge=0, le=MAX_ID, description="list the rows after this id (0: first)")
    limit: int = Field(100, ge=1, le=1000, description="at most this many ledger rows")


def dataset_out(dataset: Dataset, operator: bool) -> DatasetOut:
    out = DatasetOut.model_validate(dataset, from_attributes=True)
    if not operator:
        out.source = out.options = out.created_at = None
    return out


def _check_source(source: str, data_dir: Path) -> None:
    """File paths are relative to DATA_DIR and must stay inside it, out of ``uploads/``."""
    kind, _, name = source.partition(":")
    if kind not in ("npz", "csv", "parquet"):
        return
    relative = Path(name)
    resolved = (data_dir / relative).resolve()
    if relative.is_absolute() or not resolved.is_relative_to(data_dir):
        raise field_error("source", f"{kind} path must be a file under DATA_DIR")
    if resolved.is_relative_to(data_dir / UPLOADS):
        raise field_error("source", f"{UPLOADS}/ holds uploaded datasets: upload the file")


def _load_error(error: Exception, field: str, what: str) -> HTTPException:
    """A loader's ``dataset.<field>: reason`` as a 422 naming the option or label set at fault,
    or else ``field`` (the source, or the uploaded body)."""
    named, _, reason = str(error).removeprefix("dataset.").partition(": ")
    if (named.startswith("options.") or named == "num_classes") and reason:
        return field_error(named, reason)
    return field_error(field, f"cannot load {what}: {reason or error}")


def _claim_name(session: SessionDep, name: str) -> None:
    """Begin the registration's write transaction (so that a concurrent writer cannot make it
    fail with "database is locked" on SQLite) and check that the name is free within it."""
    begin_write(session)
    if session.execute(select(Dataset.id).where(Dataset.name == name)).first():
        raise field_error("name", f"a dataset named {name!r} exists", 409)


@router.post("", status_code=status.HTTP_201_CREATED, responses=responses(403, 409))
def register(
    body: DatasetIn, session: SessionDep, settings: SettingsDep, _: Operator
) -> DatasetOut:
    with heap.frozen_imports():  # torch: loaded only when a dataset is registered
        from workers.data import declared, describe

    _check_source(body.source, settings.data_path)
    if body.format is not None:  # announced for upload: registered without data
        try:
            declared(body.format, body.options, body.num_classes)
        except ValueError as error:
            raise _load_error(error, "options", body.format) from None
        _claim_name(session, body.name)
        dataset = Dataset(
            name=body.name,
            source=body.source,
            options=body.options,
            n=0,
            num_classes=body.num_classes,
            input_shape=[],
            public_validation=False,
            public=body.public,
            epsilon=body.epsilon,
            delta=body.delta,
            content_sha256="",
        )
        session.add(dataset)
        session.flush()
        dataset.source = f"{body.format}:{UPLOADS}/{dataset.id}.{body.format}"
        session.commit()
        return dataset_out(dataset, operator=True)
    try:
        info = describe(
            body.source,
            settings.data_path,
            body.options,
            body.num_classes,
            settings.max_dataset_bytes,
        )
    except (ValueError, OSError, KeyError) as error:
        raise _load_error(error, "source", repr(body.source)) from None
    _claim_name(session, body.name)
    dataset = Dataset(
        name=body.name,
        source=body.source,
        options=body.options,
        n=info.n,
        num_classes=info.num_classes,
        input_shape=list(info.input_shape),
        public_validation=info.public_validation,
        public=body.public,
        epsilon=body.epsilon,
        delta=body.delta,
        content_sha256=info.sha256,
    )
    session.add(dataset)
    session.commit()
    return dataset_out(dataset, operator=True)


@router.put("/{dataset_id}/data", responses=responses(403, 404, 409))
async def upload(dataset_id: Id, request: Request, settings: SettingsDep, _: Operator) -> UploadOut:
    """The file of a dataset announced for upload, streamed to disk (never whole in memory,
    at most ``DPTUNE_MAX_UPLOAD_BYTES``), then read and checked as trials read it. Only a file
    that passes is moved into place, and only once: a dataset's budget belongs to its data."""
    with heap.frozen_imports():  # torch
        from workers.data import describe

    sessions: sessionmaker = request.app.state.sessions
    dataset = await run_in_threadpool(_awaiting, sessions, dataset_id)
    kind, _, name = dataset.source.partition(":")
    target = settings.data_path / name
    target.parent.mkdir(exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(
        prefix=".upload-", suffix=f".{kind}", dir=target.parent
    )
    partial = Path(temporary)
    try:
        size, sha256 = await _receive(request, os.fdopen(descriptor, "wb"))
        if size == 0:
            raise field_error("body", f"empty: send the {kind} file")
        relative = partial.relative_to(settings.data_path)
        try:
            info = await run_in_threadpool(
                describe,
                f"{kind}:{relative}",
                settings.data_path,
                dataset.options,
                dataset.num_classes,
                settings.max_dataset_bytes,
            )
        except (ValueError, OSError, KeyError) as error:
            raise _load_error(error, "body", f"the uploaded {kind} file") from None
        values = {
            "n": info.n,
            "input_shape": list(info.input_shape),
            "public_validation": info.public_validation,
            "content_sha256": info.sha256,
        }
        await run_in_threadpool(_install, sessions, dataset, values, partial, target)
    finally:
        partial.unlink(missing_ok=True)
    out = dataset_out(dataset, operator=True)
    return UploadOut(**out.model_dump(), file_bytes=size, file_sha256=sha256)


def _awaiting(sessions: sessionmaker, dataset_id: int) -> Dataset:
    """The dataset, if it awaits its upload: 404 if there is none, 409 if it has data."""
    with sessions() as session:
        dataset = session.get(Dataset, dataset_id)
    if dataset is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"dataset {dataset_id} not found")
    if not dataset.awaiting_data:
        raise _has_data(dataset_id)
    return dataset


def _has_data(dataset_id: int) -> HTTPException:
    return field_error(
        "dataset",
        f"dataset {dataset_id} has its data already: its privacy budget belongs to that "
        "data, and replacing the data would reset the privacy accounting. Register the new "
        "data as a new dataset.",
        status.HTTP_409_CONFLICT,
    )


async def _receive(request: Request, file: IO[bytes]) -> tuple[int, str]:
    """Write the body to ``file`` as it arrives (flushed to disk before the dataset points at
    it); its size and SHA-256."""
    digest, size = hashlib.sha256(), 0

    def write(chunk: bytes) -> None:
        digest.update(chunk)
        file.write(chunk)

    with file:
        async for chunk in request.stream():
            if chunk:
                size += len(chunk)
                await run_in_threadpool(write, chunk)
        await run_in_threadpool(lambda: (file.flush(), os.fsync(file.fileno())))
    return size, digest.hexdigest()


def _install(
    sessions: sessionmaker, dataset: Dataset, values: dict[str, Any], partial: Path, target: Path
) -> None:
    """Record the data and move its file into place, in one transaction that takes the dataset
    only while it still awaits data: of two concurrent uploads, one wins, the other gets 409
    and never touches the file of the first."""
    with sessions() as session:
        begin_write(session)
        claimed = session.execute(
            update(Dataset).where(Dataset.id == dataset.id, Dataset.n == 0).values(**values)
        )
        if claimed.rowcount != 1:  # type: ignore[attr-defined]
            if session.get(Dataset, dataset.id) is None:  # deleted meanwhile
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"dataset {dataset.id} not found")
            raise _has_data(dataset.id)
        os.replace(partial, target)
        session.commit()
    for key, value in values.items():
        setattr(dataset, key, value)


@router.get("", responses=COUNTED)
def list_datasets(
    session: SessionDep, caller: Caller, params: Annotated[Page, Query()], response: Response
) -> list[DatasetOut]:
    query = select(Dataset).order_by(Dataset.id)
    if not caller.is_operator:
        query = query.where(Dataset.id.in_(caller.dataset_ids))
    return [dataset_out(d, caller.is_operator) for d in page(session, response, query, params)]


@router.get("/{dataset_id}", responses=responses(404))
def get_dataset(dataset_id: Id, session: SessionDep, caller: Caller) -> DatasetOut:
    return dataset_out(visible_dataset(session, caller, dataset_id), caller.is_operator)


@router.delete(
    "/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT, responses=responses(403, 404, 409)
)
def delete_dataset(dataset_id: Id, session: SessionDep, settings: SettingsDep, _: Operator) -> None:
    """Delete a dataset that was never charged and never had a job (409 naming what it has
    otherwise), with its uploaded file. It holds the dataset's budget lock, as admission
    does, so that no job is admitted on it meanwhile; keys lose it from their scope."""
    dataset = locked_dataset(session, dataset_id)
    if dataset is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"dataset {dataset_id} not found")
    used = _used_by(session, dataset_id)
    if used is not None:
        raise field_error(
            "dataset", f"dataset {dataset_id} cannot be deleted: {used}", status.HTTP_409_CONFLICT
        )
    session.execute(delete(api_key_dataset).where(api_key_dataset.c.dataset_id == dataset_id))
    session.delete(dataset)
    session.commit()
    kind, _, name = dataset.source.partition(":")
    if name == f"{UPLOADS}/{dataset_id}.{kind}":  # the service's; a registered file is not
        (settings.data_path / name).unlink(missing_ok=True)


def _used_by(session: Session, dataset_id: int) -> str | None:
    """Why the dataset must stay, or None: a ledger row (append-only: invariant 7), or a job
    that trains on it or searches on it as its proxy."""
    charged = select(LedgerEntry.id).where(LedgerEntry.dataset_id == dataset_id).limit(1)
    if session.execute(charged).first() is not None:
        return "its ledger has rows, and the ledger is append-only"
    uses = or_(Job.dataset_id == dataset_id, Job.spec["proxy"].as_integer() == dataset_id)
    job = session.execute(select(Job.id).where(uses).order_by(Job.id).limit(1)).scalar()
    if job is not None:
        return f"job {job} uses it"
    return None


@router.get("/{dataset_id}/budget", responses=responses(404))
def get_budget(
    dataset_id: Id, session: SessionDep, caller: Caller, limit: Limit = 100
) -> BudgetOut:
    """Spent and reserved ε, composed over the whole ledger (docs/design.md, invariant 7), read
    from its running sums; and the newest ledger rows. The query reads all of it in one
    transaction (SQLite) or snapshot-consistent statements."""
    dataset = visible_dataset(session, caller, dataset_id)
    state = ledger.budget(session, dataset)
    newest = visibility.ledger_rows(caller, dataset).order_by(LedgerEntry.id.desc()).limit(limit)
    return BudgetOut(
        epsilon=state.epsilon,
        delta=state.delta,
        spent=state.spent,
        reserved=state.reserved,
        remaining=state.remaining,
        entries=_entries(session, caller, dataset, newest)[::-1],
        entries_total=visibility.entries_total(caller, dataset),
    )


@router.get("/{dataset_id}/ledger", responses=responses(404) | COUNTED)
def get_ledger(
    dataset_id: Id,
    session: SessionDep,
    caller: Caller,
    params: Annotated[LedgerQuery, Query()],
    response: Response,
) -> LedgerOut:
    """The ledger rows the caller sees, in id order, a page at a time; how many in all in
    ``X-Total-Count``."""
    dataset = visible_dataset(session, caller, dataset_id)
    rows = visibility.ledger_rows(caller, dataset).where(LedgerEntry.id > params.after)
    limit = params.limit
    shown = _entries(session, caller, dataset, rows.order_by(LedgerEntry.id).limit(limit + 1))
    more = len(shown) > limit
    response.headers[TOTAL] = str(visibility.entries_total(caller, dataset))
    return LedgerOut(entries=shown[:limit], next_after=shown[limit - 1].id if more else None)


def _entries(
    session: SessionDep, caller: Caller, dataset: Dataset, rows: Select[tuple[LedgerEntry]]
) -> list[EntryOut]:
    views = visibility.ledger_entries(session, caller, dataset, rows)
    return [EntryOut.model_validate(e, from_attributes=True) for e in views]
