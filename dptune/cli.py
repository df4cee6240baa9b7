"""The client's verbs on the ``dptune`` command line: ``jobs``, ``budget``, ``datasets``,
``keys``. Each prints a table, or with ``--json`` the service's view for scripts; an error
answer prints ``dptune: <field>: <message>`` on stderr and exits 1 (typer exits 2 on a
usage error)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dptune.client import DEFAULT_URL, Client
from dptune.errors import ApiError, DptuneError

Url = Annotated[str, typer.Option(envvar="DPTUNE_URL", help="The dptune API.")]
Key = Annotated[str | None, typer.Option(envvar="DPTUNE_API_KEY", help="An API key.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON (the service's view).")]
Id = Annotated[int, typer.Argument(min=1)]

jobs = typer.Typer(no_args_is_help=True, help="Submit, follow and cancel tuning jobs.")
datasets = typer.Typer(no_args_is_help=True, help="Datasets the key may use.")
keys = typer.Typer(no_args_is_help=True, help="API keys (operators).")


@contextmanager
def _client(url: str, key: str | None) -> Iterator[Client]:
    """A client; an error becomes one line on stderr and exit status 1."""
    try:
        with Client(url, key) as client:
            yield client
    except ApiError as error:
        where = f"{error.field}: " if error.field else ""
        typer.echo(f"dptune: {where}{error.message}", err=True)
        raise typer.Exit(1) from None
    except DptuneError as error:
        typer.echo(f"dptune: {error}", err=True)
        raise typer.Exit(1) from None


def _show(data: BaseModel | Sequence[BaseModel], as_json: bool, columns: Sequence[str]) -> None:
    """``data`` as JSON, or a table of ``columns``."""
    items = [data] if isinstance(data, BaseModel) else list(data)
    dumped = [item.model_dump(mode="json") for item in items]
    if as_json:
        typer.echo(json.dumps(dumped[0] if isinstance(data, BaseModel) else dumped, indent=2))
        return
    table = Table(*columns)
    for row in dumped:
        table.add_row(*(escape(_cell(row.get(c))) for c in columns))  # server text, not markup
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    return "" if value is None else str(value)


JOB = ("id", "dataset", "status", "accounting", "progress", "reason")


@jobs.command("submit")
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A job spec (JSON).")],
    wait: Annotated[bool, typer.Option(help="Wait until the job ends.")] = False,
    idempotency_key: Annotated[str | None, typer.Option(help="Retry-safe submission.")] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: Json = False,
) -> None:
    """Submit a job: its ε is reserved on the dataset's budget. With --wait, exit status 1
    when the job ends failed or cancelled."""
    try:
        body = json.loads(spec.read_text())
    except ValueError as error:
        raise typer.BadParameter(f"not JSON: {error}", param_hint="SPEC") from None
    with _client(url, key) as client:
        job = client.submit(body, idempotency_key)
        view = job.wait(progress=not as_json) if wait else job.view
    _show(view, as_json, JOB)
    if view.status in ("failed", "cancelled"):
        typer.echo(f"dptune: job {view.id} {view.status}: {view.reason or ''}", err=True)
        raise typer.Exit(1)


@jobs.command("list")
def list_jobs(
    status: Annotated[str | None, typer.Option(help="Only jobs in this status.")] = None,
    dataset: Annotated[int | None, typer.Option(help="Only jobs on this dataset.")] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: Json = False,
) -> None:
    """The key's jobs, newest first."""
    with _client(url, key) as client:
        views = [job.view for job in client.jobs(status, dataset)]
    _show(views, as_json, JOB)


def _job_verb(
    act: Callable[[Client, int], BaseModel | list[Any]], columns: Sequence[str]
) -> Callable[..., None]:
    """A command ``ID [--url --key --json]`` that prints what ``act`` returns."""

    def command(job: Id, url: Url = DEFAULT_URL, key: Key = None, as_json: Json = False) -> None:
        with _client(url, key) as client:
            data = act(client, job)
        _show(data, as_json, columns)

    return command


jobs.command("show", help="A job as the key sees it.")(_job_verb(lambda c, i: c.job(i).view, JOB))
jobs.command("trials", help="A job's trials as the key sees them.")(
    _job_verb(lambda c, i: c.job(i).trials(), ("index", "status", "params", "score", "released"))
)
jobs.command("cancel", help="Ask a job to stop (ε consumed is not refunded).")(
    _job_verb(lambda c, i: c.job(i).cancel(), JOB)
)


@jobs.command("model")
def model(
    job: Id,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write it.")],
    url: Url = DEFAULT_URL,
    key: Key = None,
) -> None:
    """Download a job's released model (safetensors)."""
    with _client(url, key) as client:
        client.job(job).download(output)
    typer.echo(f"wrote {output}")


@jobs.command("logs")
def logs(job: Id, url: Url = DEFAULT_URL, key: Key = None) -> None:
    """A job's driver log (operators)."""
    with _client(url, key) as client:
        handle = client.job(job)
        offset = 0
        while True:
            page = handle.logs(offset)
            for line in page.lines:
                typer.echo(line)
            if not page.lines:
                break
            offset = page.next_offset


def budget(dataset: Id, url: Url = DEFAULT_URL, key: Key = None, as_json: Json = False) -> None:
    """A dataset's privacy budget: ε spent, reserved and remaining."""
    with _client(url, key) as client:
        data = client.budget(dataset)
    _show(data, as_json, ("epsilon", "delta", "spent", "reserved", "remaining"))


DATASET = ("id", "name", "n", "epsilon", "delta")


@datasets.command("list")
def list_datasets(url: Url = DEFAULT_URL, key: Key = None, as_json: Json = False) -> None:
    """The datasets the key may use."""
    with _client(url, key) as client:
        data = client.datasets()
    _show(data, as_json, DATASET)


@datasets.command("show")
def show_dataset(
    dataset: Id, url: Url = DEFAULT_URL, key: Key = None, as_json: Json = False
) -> None:
    """One dataset."""
    with _client(url, key) as client:
        data = client.dataset(dataset)
    _show(data, as_json, DATASET)


KEY = ("id", "name", "role", "datasets", "revoked_at")


@keys.command("list")
def list_keys(url: Url = DEFAULT_URL, key: Key = None, as_json: Json = False) -> None:
    """Every API key."""
    with _client(url, key) as client:
        data = client.keys()
    _show(data, as_json, KEY)


@keys.command("create")
def create_key(
    name: str,
    role: Annotated[str, typer.Option(help="operator or analyst.")],
    dataset: Annotated[list[int] | None, typer.Option(help="A dataset it may use.")] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: Json = False,
) -> None:
    """Create a key; its secret is shown only now."""
    with _client(url, key) as client:
        data = client.create_key(name, role, dataset)
    _show(data, as_json, (*KEY, "secret"))


@keys.command("revoke")
def revoke_key(key_id: Id, url: Url = DEFAULT_URL, key: Key = None) -> None:
    """Revoke a key."""
    with _client(url, key) as client:
        client.revoke_key(key_id)
    typer.echo(f"revoked key {key_id}")


def register(app: typer.Typer) -> None:
    """Add the verbs to the ``dptune`` app."""
    app.add_typer(jobs, name="jobs")
    app.command()(budget)
    app.add_typer(datasets, name="datasets")
    app.add_typer(keys, name="keys")
