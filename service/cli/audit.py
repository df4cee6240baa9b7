"""``dptune audit``: does the privacy a trial is charged hold up? An empirical lower bound on ε.

Runs the trial's own engine once with canaries (``workers.audit``) and prints the ε the trial is
charged next to the ε it provably exceeds (Steinke, Nasr, Jagielski 2023), with the ratio. A
lower bound can only catch a bug: a bound above the claim means the build or the accountant is
broken (exit status 1); a bound below it proves nothing about the claim being right.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from core.config import TrialConfig

if TYPE_CHECKING:
    from workers.audit import AuditResult


class Kind(StrEnum):
    white = "white"
    black = "black"


def _table(r: AuditResult) -> Table:
    table = Table(title=f"dptune audit: {r.kind}-box, {r.dataset} / {r.model}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("claimed ε (charged)", f"{r.claimed_epsilon:.4f} at δ = {r.delta:g}"),
        (f"lower bound ({r.confidence:.0%})", f"{r.lower_bound:.4f}"),
        ("lower / claimed", f"{r.ratio:.3f}"),
        ("canaries m (included)", f"{r.canaries} ({r.included})"),
        ("guesses k", str(r.guesses)),
        ("correct guesses", str(r.correct)),
        ("q, steps, σ", f"{r.sample_rate:.4g}, {r.steps}, {r.noise_multiplier:.4f}"),
        ("wall time", f"{r.wall_time_s:.1f}s on {r.device}"),
    ]
    if r.noise_scale != 1:
        rows.append(("FAULT INJECTED: noise ×", f"{r.noise_scale:g}"))
    for row in rows:
        table.add_row(*row)
    return table


def audit(
    config: Annotated[
        Path,
        typer.Option(
            help="Trial config (JSON), as for `python -m workers.trial`.",
            exists=True,
            dir_okay=False,
        ),
    ],
    canaries: Annotated[
        int,
        typer.Option(
            "--canaries",
            "-m",
            help="m: canaries, each included with probability 1/2 (count toward N).",
        ),
    ] = 1000,
    guesses: Annotated[
        int,
        typer.Option(
            "--guesses",
            "-k",
            help="k: guesses, half 'in' on the highest scores, half 'out' on the lowest.",
        ),
    ] = 200,
    kind: Annotated[
        Kind,
        typer.Option(
            help="white: gradient canaries, scored on every step's noisy gradient (the stronger "
            "audit); black: input canaries, scored on the final model's losses."
        ),
    ] = Kind.white,
    noise_scale: Annotated[
        float,
        typer.Option(
            help="FAULT INJECTION, audits only: multiply the gradient noise by this factor to "
            "check that the audit catches a broken build (e.g. 0.1)."
        ),
    ] = 1.0,
    confidence: Annotated[float, typer.Option(help="Confidence of the lower bound.")] = 0.95,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the result as JSON.")
    ] = None,
) -> None:
    """Empirical privacy audit: train once with canaries and bound ε from below.

    Prints the ε the trial is charged, the lower bound, m, k, correct guesses and their ratio.
    Exit status 1 when the lower bound exceeds the claim (the claimed privacy is refuted).
    """
    from workers.audit import run_audit  # torch: imported only when a command needs it
    from workers.trial import error_message

    try:
        cfg = TrialConfig.model_validate_json(config.read_text())
        with Progress(transient=True) as progress:
            task = progress.add_task(f"audited DP training ({kind.value}-box)", total=None)
            result = run_audit(
                cfg,
                canaries=canaries,
                guesses=guesses,
                kind=kind.value,
                noise_scale=noise_scale,
                confidence=confidence,
                on_step=lambda t, total: progress.update(task, completed=t, total=total),
            )
    except ValidationError as err:
        raise typer.BadParameter(error_message(err), param_hint="--config") from err
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    Console().print(_table(result))
    if json_out is not None:
        json_out.write_text(json.dumps(result.as_dict(), indent=2))
    if result.refuted:
        typer.echo(
            f"REFUTED: ε > {result.lower_bound:.3f} with {result.confidence:.0%} "
            f"confidence, above the claimed {result.claimed_epsilon:.3f}"
        )
        raise typer.Exit(1)
    typer.echo("consistent with the claim (a lower bound can catch bugs, not certify privacy)")
