"""``dptune account``: what does a run or a tuning job cost, and what noise does it need?"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from core import accounting
from core.sampling import num_steps


class Method(StrEnum):
    all = "all"
    single = "single"
    rdp = "rdp"
    lt = "lt"
    ps = "ps"


def _method(
    name: str,
    trials: int,
    gamma: float | None,
    delta2: float | None,
    eta: float | None,
    delta: float,
) -> accounting.TuningMethod:
    """The CLI's options as a tuning method (``single``: one trial). Liu–Talwar's δ₂ defaults
    to planning's share of δ (``LT_DELTA2_SHARE``). As planning states a job, a fixed K is also
    bounded by its pessimistic PLD and a truncated-negative-binomial K by its privacy profile,
    both at δ, and the smaller bound states it."""
    params: dict[str, Any] = {
        "single": {"trials": 1, "pld_delta": delta},
        "rdp": {"trials": trials, "pld_delta": delta},
        "lt": {
            "gamma": gamma if gamma is not None else 1 / trials,
            "delta2": delta2 if delta2 is not None else accounting.LT_DELTA2_SHARE * delta,
        },
        "ps": {"mean": float(trials), "eta": eta, "profile_delta": None if eta is None else delta},
    }[name]
    return accounting.tuning_method("rdp" if name == "single" else name, **params)


def _row(
    name: str,
    q: float,
    steps: int,
    delta: float,
    sigma: float | None,
    target: float | None,
    histogram_noise: float | None,
    method: accounting.TuningMethod,
) -> dict[str, Any]:
    if sigma is None:
        sigma = accounting.calibrate_noise(q, steps, target, delta, method)  # type: ignore[arg-type]
    trial = accounting.trial_rdp(q, sigma, steps)
    mechanisms = (accounting.TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps),)
    exclude = {"kind", "pld_delta", "profile_delta"}
    row: dict[str, Any] = {
        "method": name,
        "noise_multiplier": sigma,
        "sample_rate": q,
        "steps": steps,
        "epsilon": method.epsilon(trial, delta, mechanisms),
        "bound": _bound(method, trial, delta, mechanisms),
        "rdp_epsilon": method.epsilon(trial, delta),
        "delta": delta,
        "params": {} if name == "single" else method.model_dump(exclude=exclude),
    }
    if histogram_noise is not None:
        row["gradient_noise"] = accounting.split_noise(sigma, histogram_noise)
    if isinstance(method, accounting.LiuTalwar):
        bound = method.bound(trial, delta)
        row["max_trials"] = bound.max_trials
        row["trial_epsilon"], row["trial_delta"] = bound.trial_epsilon, bound.trial_delta
    return row


def _bound(
    method: accounting.TuningMethod,
    trial: Any,
    delta: float,
    mechanisms: tuple[accounting.TrialMechanism, ...],
) -> str:
    """Which bound states the job: RDP, the PLD of a fixed K, or a random K's privacy profile."""
    if isinstance(method, accounting.Rdp | accounting.PapernotSteinke):
        return method.bound(trial, delta, mechanisms)
    return "rdp"


def _describe(row: dict[str, Any]) -> str:
    p = row["params"]
    if row["method"] == "rdp":
        return f"K = {p['trials']}"
    if row["method"] == "lt":
        return (
            f"γ = {p['gamma']:.3g}, δ₂ = {p['delta2']:.2g}, T = {row['max_trials']}, "
            f"ε₁ = {row['trial_epsilon']:.4g} at δ₁ = {row['trial_delta']:.2g}"
        )
    if row["method"] == "ps":
        dist = "Poisson" if p["eta"] is None else f"TNB η = {p['eta']:g}"
        return f"E[K] = {p['mean']:g}, {dist}"
    return ""


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="dptune privacy cost")
    for col in ("method", "σ", "σ_T", "q", "steps", "ε", "bound", "ε by RDP", "δ", "details"):
        table.add_column(col, justify="left" if col in ("method", "details") else "right")
    for r in rows:
        sigma_t = f"{r['gradient_noise']:.4f}" if "gradient_noise" in r else "—"
        table.add_row(
            r["method"],
            f"{r['noise_multiplier']:.4f}",
            sigma_t,
            f"{r['sample_rate']:.4g}",
            str(r["steps"]),
            f"{r['epsilon']:.4f}",
            r["bound"],
            f"{r['rdp_epsilon']:.4f}",
            f"{r['delta']:.2g}",
            _describe(r),
        )
    return table


def account(
    sample_rate: Annotated[
        float | None,
        typer.Option(
            "--sample-rate",
            "-q",
            help="Poisson sampling rate q = B/N (or give --dataset-size and --batch-size).",
        ),
    ] = None,
    dataset_size: Annotated[int | None, typer.Option(help="N, training examples.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="B, expected batch size.")] = None,
    steps: Annotated[int | None, typer.Option(help="DP-SGD steps per trial.")] = None,
    epochs: Annotated[
        float | None,
        typer.Option(
            help="Epochs per trial (with N and B); steps = round(epochs·N/B), as the engine runs."
        ),
    ] = None,
    noise: Annotated[
        float | None,
        typer.Option("--noise", "-s", help="Noise multiplier σ: answers 'what does this cost?'."),
    ] = None,
    target_epsilon: Annotated[
        float | None,
        typer.Option(
            "--target-epsilon",
            "-e",
            help="Target ε: answers 'what noise do I need?' (σ calibrated per method).",
        ),
    ] = None,
    delta: Annotated[float, typer.Option(help="δ of the run or of the whole job.")] = 1e-5,
    method: Annotated[
        Method, typer.Option(help="Accounting method (see above); all: every method side by side.")
    ] = Method.all,
    trials: Annotated[
        int, typer.Option(help="rdp: number of trials K; lt: 1/γ unless --gamma; ps: E[K].")
    ] = 10,
    gamma: Annotated[float | None, typer.Option(help="lt: stop probability γ.")] = None,
    delta2: Annotated[float | None, typer.Option(help="lt: δ₂ (default δ/2, as planning).")] = None,
    eta: Annotated[
        float | None,
        typer.Option(help="ps: shape η of the truncated negative binomial (1 = geometric)."),
    ] = 1.0,
    poisson: Annotated[bool, typer.Option("--poisson", help="ps: K ~ Poisson(E[K]).")] = False,
    histogram_noise: Annotated[
        float | None,
        typer.Option(
            help="DC-SGD histogram noise σ_H: also show the gradient's σ_T (paper 001 Thm 2)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What does a DP-SGD run or a tuning job cost (ε at δ), and what noise does it need?

    single: one DP-SGD run (no tuning).

    rdp: K fixed trials (a grid), RDP curves summed; every trial may be released.

    lt: Liu–Talwar random stopping (paper 001, Thm 1): stop w.p. γ after each trial.

    ps: Papernot–Steinke (ICLR 2022): K ~ Poisson or truncated negative binomial; best only.

    As a job is planned, ε is the smallest sound bound at δ (the bound column says which): RDP;
    for single and rdp also the pessimistic PLD of the K-fold composition; for ps with η also
    the privacy-profile bound. σ for a target ε is calibrated against it.
    """
    try:
        q, n_steps = _resolve_schedule(sample_rate, dataset_size, batch_size, steps, epochs)
        if (noise is None) == (target_epsilon is None):
            raise ValueError("give exactly one of --noise or --target-epsilon")
        methods = ["single", "rdp", "lt", "ps"] if method is Method.all else [method.value]
        rows = [
            _row(
                m,
                q,
                n_steps,
                delta,
                noise,
                target_epsilon,
                histogram_noise,
                _method(m, trials, gamma, delta2, None if poisson else eta, delta),
            )
            for m in methods
        ]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        Console().print(_table(rows))


def _resolve_schedule(
    sample_rate: float | None,
    dataset_size: int | None,
    batch_size: int | None,
    steps: int | None,
    epochs: float | None,
) -> tuple[float, int]:
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of --steps or --epochs")
    if dataset_size is not None and batch_size is not None:
        if not 0 < batch_size <= dataset_size:
            raise ValueError("--batch-size must be in [1, --dataset-size]")
        sample_rate = batch_size / dataset_size
        if epochs is not None:
            if not epochs > 0:
                raise ValueError("--epochs must be positive")
            steps = num_steps(dataset_size, batch_size, epochs)
    elif sample_rate is None or epochs is not None:
        raise ValueError(
            "give --dataset-size and --batch-size (with --epochs or --steps), "
            "or --sample-rate with --steps"
        )
    return sample_rate, steps
