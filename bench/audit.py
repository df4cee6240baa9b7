"""How tight is the empirical privacy audit? Lower bound / charged ε, white-box and black-box.

    python bench/audit.py --json audit.json   # ε ∈ {1, 2, 4, 8} × {white, black}, 5 runs each
    python bench/audit.py --quick             # ε ∈ {1, 8}, one run each, under a minute

Every run is ``workers.audit.run_audit`` on one trial config (digits, a one-hidden-layer MLP,
10 epochs at B = 64, SGD with momentum; σ calibrated to each ε at δ = 10⁻⁵) with m = 1000
canaries and k = 200 guesses, so each row's ratios are measured side by side on the same
engine. Two more rows per kind inject a fault (gradient noise × 0.1 at a claimed ε = 1): there
the ratio must exceed 1. Prints a markdown table (mean over the runs, min–max in brackets) and
writes every run's result as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from core.config import TrialConfig
from workers.audit import AuditResult, CanaryKind, run_audit

KINDS: tuple[CanaryKind, ...] = ("white", "black")
BROKEN = (1.0, 0.1)  # claimed ε, noise scale of the fault-injected rows


def trial_config(dataset: str, epsilon: float) -> TrialConfig:
    return TrialConfig.model_validate(
        {
            "dataset": {"source": f"builtin:{dataset}"},
            "model": {"name": "mlp", "options": {"hidden": 64, "layers": 1}},
            "epochs": 10,
            "batch_size": 64,
            "target_epsilon": epsilon,
            "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
            "device": "cpu",
        }
    )


def _spread(values: list[float], digits: int) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def table_row(runs: list[AuditResult]) -> str:
    r = runs[0]
    fault = "" if r.noise_scale == 1 else f", noise × {r.noise_scale:g}"
    cells = [
        f"{r.kind}{fault}",
        f"{r.claimed_epsilon:.2f}",
        _spread([x.lower_bound for x in runs], 2),
        _spread([x.ratio for x in runs], 3),
        str(r.canaries),
        str(r.guesses),
        _spread([float(x.correct) for x in runs], 0),
        f"{statistics.fmean(x.wall_time_s for x in runs):.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", choices=["digits", "mnist1d"], default="digits")
    parser.add_argument("--kinds", choices=KINDS, nargs="+", default=list(KINDS))
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--runs", type=int, default=5, help="audits per row")
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--guesses", type=int, default=200)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steady on a shared 2-core machine)",
    )
    parser.add_argument("--quick", action="store_true", help="ε ∈ {1, 8}, one run per row")
    parser.add_argument("--json", type=Path, help="write every run's result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    epsilons, runs = ([1.0, 8.0], 1) if args.quick else (args.epsilons, args.runs)
    rows = [(kind, eps, 1.0) for kind in args.kinds for eps in epsilons]
    rows += [(kind, *BROKEN) for kind in args.kinds]

    print(
        f"{args.dataset}, m = {args.canaries}, k = {args.guesses}, {runs} run(s) per row, "
        "95% confidence\n"
    )
    print("| kind | claimed ε | lower bound | lower / claimed | m | k | correct | s / run |")
    print("|---|---|---|---|---|---|---|---|")
    results: list[dict[str, Any]] = []
    for kind, eps, scale in rows:
        cfg = trial_config(args.dataset, eps)
        done = [
            run_audit(
                cfg, canaries=args.canaries, guesses=args.guesses, kind=kind, noise_scale=scale
            )
            for _ in range(runs)
        ]
        print(table_row(done), flush=True)
        results += [{"config": cfg.model_dump(mode="json"), **r.as_dict()} for r in done]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
