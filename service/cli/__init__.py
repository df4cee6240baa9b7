"""The ``dptune`` command line."""

import typer

from service.cli import account, audit, db, demo, ray, report, serve

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """dptune: tune differentially private training and charge the whole search to a
    per-dataset privacy budget."""


app.command()(account.account)
app.command()(serve.serve)
app.command()(demo.demo)
app.command()(audit.audit)
app.add_typer(db.app, name="db")
app.add_typer(ray.app, name="ray")
app.command()(report.report)
