"""Job overhead: a tuning job's wall time against the sum of its trials' training times.

Runs real jobs through the product's path — a Ray head started with ``ray start`` (token
auth on, 2 CPUs), ``dptune serve`` against it, a dataset registered and a job POSTed over
HTTP — and reads back what each trial reported to Ray Tune (its ``timings``, from the Tune
results under the data dir; ``runner.trainable``). Three jobs of 10 trials each, one trial at
a time (each reserves both CPUs): short trials (logistic regression on digits, 1 epoch),
medium ones (an MLP on digits, 16 epochs: trials of about a second) and long
ones (the MLP, ``--long-epochs`` of them: enough epochs for the 30-second trials of the job
wall goal, docs/performance.md; ``--quick``: 3 epochs). ``--compare`` runs every job twice:
with trial processes reused (the default) and with ``DPTUNE_REUSE_TRIAL_PROCESSES=0`` (a fresh
Ray worker process per trial); ``--jobs`` picks among ``short,medium,long``.

Before the measured jobs, a one-trial job of another shape runs unmeasured (``--cold``: not),
so that they meet a service and a cluster that have run a job before, as in steady use: the
first job on a fresh Ray head pays more for its submission (the Jobs API's first), and one on
a fresh service plans its shape afresh — the measured jobs still do, as a new shape would.

Columns: ``wall`` from the POST to the job's end (released); ``train`` the sum of the trials'
training loops (``run_trial``: steps, epoch metrics and their progress calls); ``ratio``
wall/train (and the trials alone: first trial's start to last one's end, over train);
``driver`` from the POST to the first trial's start (Ray job submission, the driver's imports,
``ray.init``, Tune's set-up, the first worker's spawn and imports); ``start-up`` per trial
(after the first), from the previous trial's last training step to this one's first, split
into ``between`` (the previous trial's scoring, weights and report, Tune's bookkeeping and,
for a fresh process, its spawn and imports: ``spawn+imports``), ``attempt`` (recording the
attempt with the control plane), ``data`` (reading the dataset) and ``setup`` (model, engine,
copies); ``reporting progress``, per trial, what its progress reports to the control plane and
to Tune took (``runner.client.Progress``: in the training loop, and the last one after it).

    flock /tmp/dptune-ray.lock nice -n 10 .venv/bin/python bench/job_overhead.py --compare
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the e2e tests' own Ray cluster helper
from cluster import LocalCluster, local_cluster  # noqa: E402

from service.api.server import free_port  # noqa: E402

OPERATOR_KEY = "dpt_bench-operator-key-0123456789"
HEADERS = {"Authorization": f"Bearer {OPERATOR_KEY}"}
#: epochs of the long trials' MLP on digits (``--long-epochs``)
LONG_EPOCHS = 12
#: epochs of the medium trials' MLP
MEDIUM_EPOCHS = 16


def job_spec(
    dataset: int,
    model: str,
    epochs: float,
    trials: int = 10,
    resources: dict[str, float] | None = None,
    batch_size: int = 64,
    epsilon: float = 40.0,
) -> dict[str, Any]:
    """``trials`` trials (a grid of learning rates), public validation; by default one at a
    time (each reserves both CPUs)."""
    return {
        "dataset": dataset,
        "model": {"name": model},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.5},
        "validation": {"split": "public"},
        "epochs": epochs,
        "batch_size": batch_size,
        "search_space": {
            "optimizer.lr": {"grid": [round(0.05 * (i + 1), 3) for i in range(trials)]}
        },
        "resources": resources or {"cpu": 2},
        "privacy": {"epsilon": epsilon, "accounting": "rdp"},
    }


@contextmanager
def dptune_serve(cluster: LocalCluster, data_dir: Path, reuse: bool) -> Iterator[httpx.Client]:
    """``dptune serve`` on ``data_dir`` against the cluster, as an operator starts it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_", "RAY_"))}
    env |= {
        "DPTUNE_DATA_DIR": str(data_dir),
        "DPTUNE_OPERATOR_KEY": OPERATOR_KEY,
        "DPTUNE_RAY_ADDRESS": cluster.dashboard_url,
        "DPTUNE_CONTROL_URL": url,
        "DPTUNE_POLL_INTERVAL_S": "0.5",
        "DPTUNE_REUSE_TRIAL_PROCESSES": "1" if reuse else "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(cluster.token_path),
    }
    dptune = shutil.which("dptune", path=str(Path(sys.executable).parent)) or "dptune"
    data_dir.mkdir(parents=True)
    with (data_dir / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [dptune, "serve", "--port", str(port)], env=env, stdout=log, stderr=log
        )
    try:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dptune serve did not start: {data_dir / 'serve.log'}")
                time.sleep(0.5)
            yield client
    finally:
        process.kill()
        process.wait(timeout=30)


def run_job(client: httpx.Client, spec: dict[str, Any], timeout: float) -> tuple[int, float]:
    """POST the job and wait for its end: its id and wall time (s)."""
    posted = time.time()
    r = client.post("/v1/jobs", json=spec)
    if r.status_code != 202:
        raise RuntimeError(f"job refused: {r.status_code} {r.text}")
    job = r.json()
    deadline = time.monotonic() + timeout
    while (status := client.get(f"/v1/jobs/{job['id']}").json()["status"]) in (
        "queued",
        "running",
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job['id']} still {status} after {timeout} s")
        time.sleep(0.1)
    if status != "released":
        raise RuntimeError(f"job {job['id']} ended {status}")
    return job["id"], posted


def trial_timings(data_dir: Path, job_id: int) -> list[dict[str, Any]]:
    """Each trial's ``timings`` and process id, from its last Tune result, by start."""
    rows = []
    for path in (data_dir / "ray_results" / f"dptune-job-{job_id}").glob("*/result.json"):
        last = json.loads(path.read_text().splitlines()[-1])
        rows.append({"pid": last["pid"], **last["timings"]})
    return sorted(rows, key=lambda r: r["train_started_at"])


def summarize(rows: list[dict[str, Any]], posted: float, ended: float) -> dict[str, Any]:
    """The job's numbers: wall, train, ratio, driver start, per-trial start-up split."""
    train = sum(r["train_s"] for r in rows)
    gaps = []
    for prev, row in itertools.pairwise(rows):
        prev_end = prev["train_started_at"] + prev["train_s"]
        fresh = row["imported_at"] > prev_end
        gaps.append(
            {
                "startup": row["train_started_at"] - prev_end,
                "between": row["entered_at"] - prev_end,
                "spawn+imports": row["imported_at"] - prev_end if fresh else 0.0,
                "attempt": row["attempt_s"],
                "data": row["load_s"],
                "setup": row["train_started_at"]
                - row["entered_at"]
                - row["attempt_s"]
                - row["load_s"],
            }
        )
    return {
        "trials": len(rows),
        "processes": len({r["pid"] for r in rows}),
        "wall_s": ended - posted,
        "train_s": train,
        "ratio": (ended - posted) / train,
        # the trials alone: from the first trial's start to the last one's end
        "trials_s": rows[-1]["train_started_at"] + rows[-1]["train_s"] - rows[0]["entered_at"],
        "driver_s": rows[0]["entered_at"] - posted,
        "startup_s": {k: statistics.mean(g[k] for g in gaps) for k in gaps[0]},
        "first_trial_data_s": rows[0]["load_s"],
        # progress reports inside each trial's training loop, and their last one after it
        "reporting_s": statistics.mean(r["reporting_s"] for r in rows),
    }


def standalone_imports() -> dict[str, float]:
    """What a fresh process pays before its first trial, measured here: the interpreter, torch,
    and the whole trainable (torch, Ray Tune, the engine)."""

    def wall(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
        return time.perf_counter() - started

    python = wall("pass")
    return {
        "python": python,
        "import torch": wall("import torch") - python,
        "import runner.trainable": wall("import runner.trainable") - python,
    }


def show(name: str, s: dict[str, Any]) -> None:
    split = ", ".join(f"{k} {v:.2f}" for k, v in s["startup_s"].items())
    print(
        f"{name:<24} {s['trials']:>2} trials in {s['processes']:>2} processes: wall "
        f"{s['wall_s']:6.1f} s, train {s['train_s']:6.1f} s, ratio {s['ratio']:.2f}× (trials "
        f"alone {s['trials_s'] / s['train_s']:.2f}×), driver {s['driver_s']:.1f} s; start-up "
        f"per trial (mean s): {split}; reporting progress {s['reporting_s']:.3f} s a trial",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="long trials of 3 epochs, not 12")
    parser.add_argument(
        "--long-epochs",
        type=int,
        default=LONG_EPOCHS,
        help="epochs of the long trials (160: about 30 s each on an idle 2-core machine)",
    )
    parser.add_argument("--medium-epochs", type=int, default=MEDIUM_EPOCHS)
    parser.add_argument("--compare", action="store_true", help="also without process reuse")
    parser.add_argument("--jobs", default="short,medium,long", help="which of short,medium,long")
    parser.add_argument("--cold", action="store_true", help="no unmeasured job first")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()
    epochs = args.long_epochs // 4 if args.quick else args.long_epochs
    jobs = {
        name: job
        for name, job in [
            ("short (logreg, 1 epoch)", ("logreg", 1)),
            (f"medium (mlp, {args.medium_epochs} epochs)", ("mlp", args.medium_epochs)),
            (f"long (mlp, {epochs} epochs)", ("mlp", epochs)),
        ]
        if name.split()[0] in args.jobs.split(",")
    }
    modes = [True, False] if args.compare else [True]
    results: dict[str, Any] = {"imports_s": standalone_imports()}
    print("fresh process:", {k: round(v, 2) for k, v in results["imports_s"].items()}, flush=True)
    work = Path(tempfile.mkdtemp(prefix="dpt-bench-"))
    try:
        with local_cluster() as cluster:
            cluster.start_head(num_cpus=2)
            cluster.wait_for_nodes()
            for reuse in modes:
                data_dir = work / ("reuse" if reuse else "fresh")
                with dptune_serve(cluster, data_dir, reuse) as client:
                    r = client.post(
                        "/v1/datasets",
                        json={
                            "name": "digits",
                            "source": "builtin:digits",
                            "epsilon": 100.0,
                            "delta": 1e-5,
                        },
                    )
                    r.raise_for_status()
                    if not args.cold:  # one trial of its own shape: its plan is not reused
                        warm_up = job_spec(r.json()["id"], "logreg", 1, 1, batch_size=32, epsilon=1)
                        run_job(client, warm_up, timeout=600)
                    for name, (model, epochs) in jobs.items():
                        spec = job_spec(r.json()["id"], model, epochs, epsilon=25)
                        job_id, posted = run_job(client, spec, timeout=1800)
                        ended = time.time()
                        rows = trial_timings(data_dir, job_id)
                        label = f"{name}, {'reused' if reuse else 'fresh'}"
                        results[label] = summarize(rows, posted, ended)
                        show(label, results[label])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
