"""What the dataset's privacy filter costs: jobs a dataset admits under it against the ledger's
earlier rule, which was not a filter proven at (ε, δ).

A dataset admits jobs while its total stays within its budget; its jobs are chosen after earlier
releases, so that rule must be a privacy filter (docs/privacy.md, "The dataset's budget is a
privacy filter"). The earlier rule summed the jobs' RDP curves and took the smallest ε over the
orders: a union of per-order Rényi filters, proven at (ε, m·δ) for its m orders. The filter
(``core.accounting.filter``) reads the curves at one order fixed by the dataset's (ε, δ), holds a
tenth of δ for (ε, δ) pairs, and counts each job as its curve or as its own ε at half the free
pairs' δ, as ``Filter.pick`` chooses (so does ``service.ledger.statement``; jobs here have no
PLD or profile statement). This bench draws random sequences of DP-SGD jobs (shapes
and per-job εs of the tuning benches, σ calibrated by RDP for each job's own ε) and admits them
in order, under each rule, until one is refused; it prints how many jobs each rule admits and
what ε the admitted ones compose to under the earlier rule.

    python bench/filter_cost.py                       # budgets 1 to 16, δ = 1e-5, 200 sequences
    python bench/filter_cost.py --budgets 2 --sequences 50

Rules:

- ``earlier``: the smallest ε over all orders of the curves summed (not a proven filter);
- ``filter``: the dataset's filter, as the ledger runs it;
- ``filter, curves only``: the same with every job counted as its curve (what the pairs add).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np

from core.accounting import (
    ORDERS,
    Filter,
    PapernotSteinke,
    Rdp,
    calibrate_noise,
    epsilon_from_rdp,
    filter_order,
    rdp_curve,
    tuning_rdp,
)

#: (q, T) of the tuning bench's recipe shapes (docs/results.md: digits' cnn at B = 256 on 1294
#: training examples, mnist1d's at B = 512 on 3600) and a longer run at a small rate
SHAPES = [(256 / 1294, 202), (512 / 3600, 204), (0.04, 1000)]
#: a job's own ε, and how its trials are charged: K fixed runs (``rdp``), or the best of
#: K ~ geometric with that mean (``ps``, η = 1, by its RDP curve)
JOB_EPSILONS = [0.25, 0.5, 1.0, 2.0]
JOB_KINDS = [("rdp", 1), ("rdp", 4), ("ps", 4)]

Admits = Callable[[list[np.ndarray]], int]
"""How many of the jobs (their curves), in order, a rule admits before refusing one."""


@functools.cache
def job_curve(shape: int, epsilon: float, kind: int, delta: float) -> np.ndarray:
    """The reserved curve of a job of the shape and kind, σ calibrated to its own ε."""
    (q, steps), (name, trials) = SHAPES[shape], JOB_KINDS[kind]
    if name == "rdp":
        sigma = calibrate_noise(q, steps, epsilon, delta, Rdp(trials=trials))
        return trials * rdp_curve(q, sigma, steps)
    method = PapernotSteinke(mean=trials, eta=1.0)
    sigma = calibrate_noise(q, steps, epsilon, delta, method)
    return tuning_rdp(rdp_curve(q, sigma, steps), trials, 1.0)


def earlier(budget: float, delta: float) -> Admits:
    def admits(jobs: list[np.ndarray]) -> int:
        total = np.zeros_like(ORDERS)
        for n, curve in enumerate(jobs):
            if epsilon_from_rdp(total + curve, delta)[0] > budget:
                return n
            total = total + curve
        return len(jobs)

    return admits


def dataset_filter(budget: float, delta: float, pairs: bool = True) -> Admits:
    rule = Filter(budget, delta)

    def admits(jobs: list[np.ndarray]) -> int:
        state = (np.zeros_like(ORDERS), 0.0, 0.0)  # curves summed, pairs' ε, pairs' δ
        for n, curve in enumerate(jobs):
            total, pair_epsilon, pair_delta = state
            mine = [(curve, 0.0, 0.0)]  # the job's statements: its curve, its own pair
            d = rule.statement_delta(pair_delta)
            if pairs and d is not None:
                mine.append((0 * curve, epsilon_from_rdp(curve, d)[0], d))
            options = [(total + c, pair_epsilon + e, pair_delta + d) for c, e, d in mine]
            totals = [rule.spent(*o) for o in options]
            best = rule.pick(mine, totals)
            if totals[best] > budget:
                return n
            state = options[best]
        return len(jobs)

    return admits


def main(argv: list[str] | None = None) -> dict[float, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    out: dict[float, dict[str, float]] = {}
    print(
        "| dataset ε | rule | jobs admitted (mean) | vs earlier | ε of those jobs, earlier rule |"
    )
    print("|---|---|---:|---:|---:|")
    for budget in args.budgets:
        rules = {
            "earlier": earlier(budget, args.delta),
            "filter": dataset_filter(budget, args.delta),
            "filter, curves only": dataset_filter(budget, args.delta, pairs=False),
        }
        counts: dict[str, list[int]] = {name: [] for name in rules}
        spent: dict[str, list[float]] = {name: [] for name in rules}
        for _ in range(args.sequences):
            jobs = [
                job_curve(
                    int(rng.integers(len(SHAPES))),
                    float(rng.choice(JOB_EPSILONS)),
                    int(rng.integers(len(JOB_KINDS))),
                    args.delta,
                )
                for _ in range(64)
            ]
            for name, admits in rules.items():
                n = admits(jobs)
                counts[name].append(n)
                total = sum(jobs[:n], np.zeros_like(ORDERS))
                spent[name].append(epsilon_from_rdp(total, args.delta)[0] if n else 0.0)
        base = float(np.mean(counts["earlier"]))
        out[budget] = {}
        for name in rules:
            mean = float(np.mean(counts[name]))
            out[budget][name] = mean
            print(
                f"| {budget:g} | {name} | {mean:.2f} | {mean / base:.2f}× | "
                f"{np.mean(spent[name]):.2f} |"
            )
    alphas = ", ".join(f"{filter_order(b, args.delta):g}" for b in args.budgets)
    print(f"filter orders: {alphas} (δ = {args.delta:g})")
    return out


if __name__ == "__main__":
    main()
