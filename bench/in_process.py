"""Untuned runs and scaling jobs in one process: the product's planner and trial code, without
Ray or HTTP, scored on the held-out test split of ``bench/tuning_accuracy.py``.

    nice -n 10 .venv/bin/python bench/in_process.py --dataset digits --epsilon 1 --runs 4 \\
        --spec '{"method": {"clipping": "abadi", "threshold": 1.0}}'
    nice -n 10 .venv/bin/python bench/in_process.py --dataset mnist1d --epsilon 4 --runs 3 \\
        --scaling held --spec '{"search_space": {"optimizer.lr": {"grid": [0.0058, 0.01, 0.0173]}}}'

A run's spec is the bench's base (the cnn, Adam, public validation, total ε at δ = 1/N under
``rdp``, nothing else: the planner's recipes fill batch size, epochs, learning rate and method)
updated by ``--spec``, whose keys are dotted paths. It is planned by
``service.planning.plan_job`` (σ calibrated) and each trial run by ``workers.trial.run_trial``
on the bench's split, one torch thread. Repetitions differ by their DP noise, which comes from
OS entropy.

``--scaling`` runs the spec as a scaling job (``core.spec.Scaling``): every candidate rate at
each cheap level, the best by its DP score, then the final run. ``by-eps`` is the product's
rule (``runner.search``: each level runs the rates scaled down by its ε over the final run's,
and the final rate follows Panda et al.'s r = lr·T ∝ ε); ``held`` runs the rates as given at
every level and the final run at the levels' picks' geometric mean with weights ε², the rule
for an optimizer whose best rate does not move with ε (Adam's: docs/results.md). Prints one
JSON line a run (``--out`` appends them to a file too) and the mean ± standard deviation.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tuning_accuracy import Split, digits_split, mnist1d_split
from core.config import DatasetConfig
from core.plan import Plan
from core.spec import LEVEL, LR, JobSpec
from runner.search import (
    Candidate,
    candidates,
    final_candidate,
    level_picks,
    scaling_candidates,
)
from service.db.models import Dataset
from service.planning import PlannedJob, plan_job
from workers.trial import run_trial

SPLITS = {"digits": digits_split, "mnist1d": mnist1d_split}


def base_spec(epsilon: float, n: int) -> dict[str, Any]:
    return {
        "dataset": 1,
        "model": {"name": "cnn"},
        "optimizer": {"name": "adam"},
        "validation": {"split": "public"},
        "physical_batch_size": 256,
        "search_space": {},
        "privacy": {"epsilon": epsilon, "delta": 1 / n, "accounting": "rdp"},
        "seed": 0,
    }


def with_paths(spec: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with each dotted path of ``update`` set (a nested dict made where missing)."""
    for path, value in update.items():
        holder = spec
        *head, last = path.split(".")
        for name in head:
            holder = holder.setdefault(name, {})
        holder[last] = value
    return spec


class Runner:
    """Trains one trial of a planned job at a shape and parameters, scored on the test split."""

    def __init__(self, planned: PlannedJob, data: DatasetConfig, part: Split) -> None:
        self.planned, self.data = planned, data
        self.x, self.y = torch.as_tensor(part.x_test), part.y_test

    def __call__(self, shape: int, params: dict[str, Any]) -> tuple[float, float]:
        """The run's DP selection score and its test accuracy."""
        plan = self.planned.plan
        cfg = self.planned.spec.trial_config(self.data, plan.shapes[shape], plan.delta, params)
        out = run_trial(cfg)
        out.model.eval()
        with torch.no_grad():
            accuracy = float((out.model(self.x).argmax(1).numpy() == self.y).mean())
        return float(out.result["score"]["value"]), accuracy


def untuned(run: Runner) -> dict[str, Any]:
    _, accuracy = run(0, {})
    return {"accuracy": accuracy}


def held_final(spec: JobSpec, plan: Plan, finished: list[tuple[Candidate, float]]) -> Candidate:
    """The final run of the ``held`` rule: at the levels' picks' geometric mean, weights ε²."""
    assert plan.scaling is not None
    picks = level_picks(spec, plan, finished)
    weights = sum(epsilon**2 for epsilon, _ in picks)
    rate = math.exp(sum(epsilon**2 * math.log(lr) for epsilon, lr in picks) / weights)
    return {LR: rate, LEVEL: len(plan.scaling.levels)}


def scaling(run: Runner, rule: str) -> dict[str, Any]:
    spec, plan = run.planned.spec, run.planned.plan
    assert plan.scaling is not None
    if rule == "by-eps":
        cheap = scaling_candidates(spec, plan)
    else:
        rates = candidates(spec.search_space, spec.privacy.trials or 1, spec.seed or 0)
        cheap = [{**c, LEVEL: level} for level in range(len(plan.scaling.levels)) for c in rates]
    finished = [(c, run(c[LEVEL], c)[0]) for c in cheap]
    final = (final_candidate if rule == "by-eps" else held_final)(spec, plan, finished)
    assert final is not None
    _, accuracy = run(final[LEVEL], final)
    return {
        "accuracy": accuracy,
        "final_lr": final[LR],
        "levels": [level.epsilon for level in plan.scaling.levels],
        "final_epsilon": plan.scaling.final.epsilon,
        "cheap": [[c[LEVEL], c[LR], score] for c, score in finished],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=sorted(SPLITS), default="digits")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spec", type=json.loads, default={}, help="dotted path → value")
    parser.add_argument("--scaling", choices=["by-eps", "held"], help="run a scaling job")
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file too")
    args = parser.parse_args(argv)
    part = SPLITS[args.dataset](args)
    n = len(part.y)
    spec = with_paths(base_spec(args.epsilon, n), args.spec)
    if args.scaling:
        spec["scaling"] = spec.get("scaling") or {}
    dataset = Dataset(id=1, n=n, epsilon=100.0, delta=2 / n, public_validation=True, num_classes=10)
    with Session(create_engine("sqlite://")) as session:  # read only for lt's δ or a proxy
        planned = plan_job(JobSpec.model_validate(spec), dataset, session)
    if not args.scaling and len(planned.plan.shapes) > 1:
        parser.error("--spec plans a search over shapes: an untuned run has one")
    shape = planned.plan.shapes[-1]  # a scaling job's final run
    accuracies = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.npz"
        part.save(path)
        run = Runner(planned, DatasetConfig(source=f"npz:{path}", num_classes=10), part)
        for _ in range(args.runs):
            line = {
                "dataset": args.dataset,
                "epsilon": args.epsilon,
                "spec": args.spec,
                "scaling": args.scaling,
                "steps": shape.steps,
                "sigma": shape.noise_multiplier,
                **(scaling(run, args.scaling) if args.scaling else untuned(run)),
            }
            accuracies.append(100 * line["accuracy"])
            text = json.dumps(line)
            print(text, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(text + "\n")
    spread = f" ± {statistics.stdev(accuracies):.1f}" if len(accuracies) > 1 else ""
    print(f"test accuracy: {statistics.mean(accuracies):.1f}{spread} % over {args.runs} runs")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
