"""``dptune demo``: the whole product on embedded defaults, in a few minutes on a laptop.

It starts the service (SQLite + a local Ray head with its dashboard), registers scikit-learn's
digits with a privacy budget, submits two tuning jobs — DP-SGD with a grid over the clipping
threshold, and DC-SGD-E — shows their progress live, then prints what an operator would want
to know: every trial, what each job was charged, the budget left, the released models.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from core.accounting import gaussian_rdp, tuning_epsilon
from service.api import create_app
from service.api.server import BackgroundServer, free_port
from service.cluster import ray_orchestrator
from service.cluster.head import load_record, stop_head
from service.orchestration import OrchestratorUnavailable
from service.settings import Settings

BUDGET = {"epsilon": 8.0, "delta": 1e-5}
BASE: dict[str, Any] = {
    "model": {"name": "mlp"},
    "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.5},
    "validation": {"split": "public"},
    "epochs": 4,
    "batch_size": 128,
}
JOBS = {
    "DP-SGD, grid over the clipping threshold": {
        **BASE,
        "method": {"clipping": "abadi"},
        "search_space": {"method.threshold": {"grid": [0.1, 1.0, 5.0]}},
        "privacy": {"epsilon": 2.0, "accounting": "rdp"},
    },
    "DC-SGD-E (dynamic clipping, paper 001)": {
        **BASE,
        "method": {"clipping": "abadi", "adaptive": {"rule": "dcsgd_e", "histogram_noise": 10}},
        "privacy": {"epsilon": 2.0, "accounting": "rdp"},
    },
}
ACTIVE = ("queued", "running")


def _fresh(directory: Path) -> None:
    """Start from an empty directory (the data dir, the state dir beside it), but never wipe
    one that is not a previous demo's — nor the record of a Ray head it left running
    (``--keep-ray``), which is stopped first."""
    if directory.exists():
        if any(directory.iterdir()) and not (directory / ".dptune-demo").exists():
            raise typer.BadParameter(
                f"{directory} exists and is not a dptune demo directory", param_hint="--data-dir"
            )
        if record := load_record(directory):
            stop_head(record)
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / ".dptune-demo").touch()


def _watch(api: httpx.Client, jobs: dict[str, dict], console: Console) -> dict[str, dict]:
    """Live progress of every job until all have ended."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} trials"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {
            name: progress.add_task(
                name, total=job["progress"]["trials_total"], status=job["status"]
            )
            for name, job in jobs.items()
        }
        while any(job["status"] in ACTIVE for job in jobs.values()):
            time.sleep(1)
            for name, job in jobs.items():
                jobs[name] = job = api.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
                best = job["progress"]["best_score"]
                status = job["status"] + (f", best {best:.3f}" if best is not None else "")
                progress.update(
                    tasks[name], completed=job["progress"]["trials_done"], status=status
                )
    return jobs


def _trial_table(api: httpx.Client, name: str, job: dict) -> Table:
    table = Table(title=f"job {job['id']}: {name} — {job['status']}")
    for column in ("trial", "hyperparameters", "attempts", "steps", "val. accuracy", ""):
        table.add_column(column)
    for t in api.get(f"/v1/jobs/{job['id']}/trials").raise_for_status().json():
        params = ", ".join(f"{k} = {v}" for k, v in t["params"].items()) or "(defaults)"
        score = "—" if t["score"] is None else f"{t['score']:.3f}"
        table.add_row(
            str(t["index"]),
            params,
            str(len(t["attempts"])),
            str(t["steps"]),
            score,
            "released" if t["released"] else "",
        )
    return table


def _charged(api: httpx.Client, job: dict) -> float:
    """ε charged to the job: its trial attempts composed (every attempt that touched data)."""
    attempts = sum(len(t["attempts"]) for t in api.get(f"/v1/jobs/{job['id']}/trials").json())
    if attempts == 0:
        return 0.0
    plan = job["plan"]
    noise = plan["validation_noise"]
    return tuning_epsilon(
        plan["sample_rate"],
        plan["noise_multiplier"],
        plan["steps"],
        plan["delta"],
        "rdp",
        trials=attempts,
        extra_rdp=None if noise is None else gaussian_rdp(noise),
    )


def _summary(
    api: httpx.Client, jobs: dict[str, dict], dataset: int, data_dir: Path, console: Console
) -> None:
    for name, job in jobs.items():
        console.print(_trial_table(api, name, job))
    budget = api.get(f"/v1/datasets/{dataset}/budget").raise_for_status().json()
    table = Table(title="privacy budget of dataset 'digits'")
    for column in ("job", "planned ε", "charged ε", "released model"):
        table.add_column(column)
    for name, job in jobs.items():
        model = "—"
        if job["released"]:
            path = data_dir / "models" / f"job-{job['id']}.safetensors"
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(api.get(f"/v1/jobs/{job['id']}/model").raise_for_status().content)
            model = str(path)
        table.add_row(
            f"{job['id']}: {name}",
            f"{job['plan']['epsilon']:.3f}",
            f"{_charged(api, job):.3f}",
            model,
        )
    console.print(table)
    console.print(
        f"dataset budget ε = {budget['epsilon']:g} at δ = {budget['delta']:g}: "
        f"spent {budget['spent']:.3f} (composed over both jobs), "
        f"remaining [bold]{budget['remaining']:.3f}[/bold]"
    )


def demo(
    data_dir: Annotated[
        Path,
        typer.Option(help="Demo data (wiped at start, with its state dir <data-dir>-state)."),
    ] = Path(".dptune-demo"),
    keep_ray: Annotated[
        bool,
        typer.Option(help="Leave the local Ray head running (to browse the dashboard afterwards)."),
    ] = False,
) -> None:
    """Run the product end to end on embedded defaults: service, local Ray, two tuning jobs on
    scikit-learn's digits, their charges and the released models."""
    console = Console()
    key = f"dpt_demo-{secrets.token_urlsafe(16)}"
    settings = Settings(data_dir=data_dir, state_dir=None, operator_key=key)
    _fresh(settings.data_path)
    _fresh(settings.state_path)
    console.print("Starting the demo's own Ray head (dashboard on 127.0.0.1) …")
    port = free_port()
    orchestrator = ray_orchestrator(settings, f"http://127.0.0.1:{port}")
    head = orchestrator.local_head
    try:
        orchestrator.check()  # starts the local head
    except OrchestratorUnavailable as error:
        console.print(f"dptune demo: {head.why if head and head.why else error}")
        if head is not None:
            head.stop()  # one that started but never answered
        raise typer.Exit(1) from None
    app = create_app(settings, orchestrator, settings.poll_interval_s)
    try:
        with (
            BackgroundServer(app, port) as server,
            httpx.Client(
                base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"}
            ) as api,
        ):
            console.print(
                f"dptune API on http://127.0.0.1:{port} (docs at /docs), "
                f"Ray dashboard at {orchestrator.dashboard_url}"
            )
            dataset = (
                api.post(
                    "/v1/datasets", json={"name": "digits", "source": "builtin:digits", **BUDGET}
                )
                .raise_for_status()
                .json()
            )
            console.print(
                f"Registered digits: N = {dataset['n']}, {dataset['num_classes']} "
                f"classes, budget ε = {BUDGET['epsilon']} at δ = {BUDGET['delta']}"
            )
            jobs = {}
            for name, spec in JOBS.items():
                job = api.post("/v1/jobs", json={"dataset": dataset["id"], **spec})
                jobs[name] = job.raise_for_status().json()
                plan = jobs[name]["plan"]
                console.print(
                    f"Submitted job {jobs[name]['id']} ({name}): {plan['trials']['max']} "
                    f"trial(s), σ = {plan['noise_multiplier']:.3f}, q = {plan['sample_rate']:.4f}"
                    f", {plan['steps']} steps per trial, ε = {plan['epsilon']:.3f} reserved"
                )
            jobs = _watch(api, jobs, console)
            _summary(api, jobs, dataset["id"], data_dir, console)
            console.print(f"Ray dashboard (jobs and their logs): {orchestrator.dashboard_url}")
    finally:
        if head is not None and not keep_ray:
            head.stop()  # by its process ids: no other Ray cluster is touched
        elif head is not None:
            console.print(
                f"The Ray head keeps running: `dptune ray status --data-dir {data_dir}`; "
                f"`dptune ray stop --data-dir {data_dir}` ends it."
            )
