"""The ``dptune`` command line.

Its commands that run the service (``serve``, ``demo``, ``db``, ``ray``) import FastAPI,
SQLAlchemy and Ray, seconds of imports: :class:`Commands` imports each only when it runs, so
``dptune --help`` and the client's verbs (:mod:`dptune.cli`) start at once."""

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from dptune import cli as client_cli
from service.cli import account, audit, report

#: name → (module, attribute: a command or a Typer app, its summary in ``dptune --help``)
HEAVY = {
    "serve": (
        "service.cli.serve",
        "serve",
        "Start the HTTP API (settings from DPTUNE_* environment variables).",
    ),
    "demo": ("service.cli.demo", "demo", "Run the product end to end on embedded defaults."),
    "db": ("service.cli.db", "app", "The database schema at DPTUNE_DATABASE_URL."),
    "ray": ("service.cli.ray", "app", "The local Ray head this data directory owns."),
}


def load(name: str) -> Any:
    """The click command of ``HEAVY[name]``, its module imported now."""
    module, attribute, _ = HEAVY[name]
    target = getattr(importlib.import_module(module), attribute)
    if isinstance(target, typer.Typer):
        return typer.main.get_group(target)
    single = typer.Typer(add_completion=False)
    single.command(name)(target)
    return typer.main.get_command(single)


class LazyCommands(MutableMapping[str, Any]):
    """A group's command table in which a :data:`HEAVY` command is there from the start but
    loaded only when looked up."""

    def __init__(self, commands: Mapping[str, Any]) -> None:
        self.commands = dict(commands)
        self.heavy: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name in HEAVY:
            if name not in self.heavy:
                self.heavy[name] = load(name)
            return self.heavy[name]
        return self.commands[name]

    def __contains__(self, name: object) -> bool:
        return name in self.commands or name in HEAVY

    def __iter__(self) -> Iterator[str]:
        return iter([*self.commands, *HEAVY])

    def __len__(self) -> int:
        return len(self.commands) + len(HEAVY)

    def __setitem__(self, name: str, command: Any) -> None:
        self.commands[name] = command

    def __delitem__(self, name: str) -> None:
        del self.commands[name]


class Commands(TyperGroup):
    """The top-level group: a :data:`HEAVY` command is listed in the help by its summary and
    loaded only when it runs or is looked up."""

    listing = False

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.commands = LazyCommands(self.commands)

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if self.listing and cmd_name in HEAVY:
            return TyperCommand(cmd_name, help=HEAVY[cmd_name][2])
        return self.commands.get(cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


app = typer.Typer(cls=Commands, no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """dptune: tune differentially private training and charge the whole search to a
    per-dataset privacy budget."""


app.command()(account.account)
app.command()(audit.audit)
app.command()(report.report)
client_cli.register(app)
