"""``dptune report``: a job's trials and its dataset's budget as a PNG, fetched from the API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import httpx
import typer


def report(
    job: Annotated[int, typer.Argument(help="The job's id.", min=1)],
    key: Annotated[
        str,
        typer.Option(
            envvar="DPTUNE_API_KEY",
            help="An operator key, or the key of the analyst who submitted the job.",
        ),
    ],
    url: Annotated[
        str, typer.Option(envvar="DPTUNE_URL", help="The dptune API.")
    ] = "http://127.0.0.1:8000",
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Where to write the PNG (default job-JOB.png)."),
    ] = None,
) -> None:
    """Draw a job's trials and its dataset's budget as a PNG.

    Top: each trial's DP score against each searched hyperparameter, the released trial starred.
    Bottom: the dataset's ε spent and committed after each ledger row, and its budget.

    The picture comes from the API (GET /v1/jobs/JOB/report.png): it shows what the key may see.
    An analyst of an lt or ps job gets the released trial alone and its ledger rows untimed."""
    path = output or Path(f"job-{job}.png")
    try:
        response = httpx.get(
            f"{url.rstrip('/')}/v1/jobs/{job}/report.png",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
    except httpx.HTTPError as error:
        raise typer.BadParameter(f"cannot reach {url}: {error}", param_hint="--url") from None
    if response.status_code != 200:
        typer.echo(f"error: {response.status_code} {_detail(response)}", err=True)
        raise typer.Exit(1)
    path.write_bytes(response.content)
    typer.echo(f"wrote {path}")


def _detail(response: httpx.Response) -> str:
    """The API's error message (``detail``), or the body as text."""
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text
