"""What a proven privacy filter would cost: jobs a dataset admits under the ledger's rule against
rules proven valid when each job's ε and shape are chosen after earlier releases.

The ledger admits a job while the dataset's composed ε stays within its budget, taking the
smallest ε over the RDP orders (docs/privacy.md, "Jobs chosen after earlier releases"). Under
fully adaptive composition that rule is a union of per-order Rényi filters: proven at
(ε, m·δ) for the m orders, not (ε, δ). A Rényi filter at one order fixed in advance is proven
at (ε, δ) (Feldman & Zrnic, NeurIPS 2021); so is the union of k fixed orders each converted at
δ/k (the union bound). This bench draws random sequences of DP-SGD jobs (shapes and per-job εs
of the tuning benches, σ calibrated by RDP for each job's own ε) and admits them in order,
under each rule, until one is refused; it prints how many jobs each rule admits and what ε
the admitted ones compose to under today's rule. Route A (RDP curves) only: the rules differ
in the order, not in the route.

    python bench/filter_cost.py                       # budgets 1 to 16, δ = 1e-5, 200 sequences
    python bench/filter_cost.py --budgets 2 --sequences 50

Rules, each a conversion of the admitted jobs' summed curve:

- ``today``: the smallest ε over all orders (``core.accounting.epsilon_from_rdp``);
- ``registration``: at one order fixed when the dataset is registered, from its (ε, δ) alone:
  the order α_G at which a Gaussian mechanism's curve (ρ·α) spending the whole budget converts
  best; ``registration ×1.5``: at 1.5·α_G (composed subsampled-Gaussian curves convert best at
  a higher order than a Gaussian's);
- ``first job``: at the order where the first job's own curve converts best (its parameters
  are chosen before the dataset has released anything, so the order is fixed in advance);
- ``4 orders``: the smallest over 4 orders fixed at registration (the registration order
  ×/÷ 1.5 and 2.25), each converted at δ/4.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy.optimize import brentq

from core.accounting import (
    ORDERS,
    PapernotSteinke,
    Rdp,
    calibrate_noise,
    epsilon_from_rdp,
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

Rule = Callable[[np.ndarray], float]


def nearest(order: float) -> int:
    """The index of the order of :data:`ORDERS` nearest ``order``."""
    return int(np.argmin(np.abs(ORDERS - order)))


def at_order(curve: np.ndarray, order: float, delta: float) -> float:
    """ε of ``curve`` at the order of :data:`ORDERS` nearest ``order`` (dp-accounting's
    conversion there)."""
    i = nearest(order)
    return float(rdp_lib.compute_epsilon(ORDERS[i : i + 1], curve[i : i + 1], delta)[0])


@functools.cache
def registration_order(budget: float, delta: float) -> float:
    """The order at which a Gaussian mechanism's curve ρ·α, with ρ such that its best
    conversion is the dataset's ε, converts best: a function of (ε, δ) alone (memoized: every
    sequence of a budget asks for it)."""

    def best(rho: float) -> tuple[float, float]:
        return epsilon_from_rdp(rho * ORDERS, delta)

    rho = brentq(lambda r: best(r)[0] - budget, 1e-8, budget)
    return best(rho)[1]


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


def rules(budget: float, delta: float, first: np.ndarray) -> dict[str, Rule]:
    alpha = registration_order(budget, delta)
    first_order = epsilon_from_rdp(first, delta)[1]
    near = [alpha / 2.25, alpha / 1.5, alpha * 1.5, alpha * 2.25]
    orders = sorted({float(ORDERS[nearest(a)]) for a in near})
    return {
        "today": lambda c: epsilon_from_rdp(c, delta)[0],
        "registration": lambda c: at_order(c, alpha, delta),
        "registration ×1.5": lambda c: at_order(c, 1.5 * alpha, delta),
        "first job": lambda c: at_order(c, first_order, delta),
        f"{len(orders)} orders": lambda c: min(at_order(c, a, delta / len(orders)) for a in orders),
    }


def admitted(jobs: list[np.ndarray], rule: Rule, budget: float) -> int:
    """How many of the jobs, in order, the rule admits before refusing one."""
    total = np.zeros_like(ORDERS)
    for n, curve in enumerate(jobs):
        if rule(total + curve) > budget:
            return n
        total = total + curve
    return len(jobs)


def main(argv: list[str] | None = None) -> dict[float, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    out: dict[float, dict[str, float]] = {}
    print("| dataset ε | rule | jobs admitted (mean) | vs today | ε of those jobs today (mean) |")
    print("|---|---|---:|---:|---:|")
    for budget in args.budgets:
        counts: dict[str, list[int]] = {}
        spent: dict[str, list[float]] = {}
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
            for name, rule in rules(budget, args.delta, jobs[0]).items():
                n = admitted(jobs, rule, budget)
                counts.setdefault(name, []).append(n)
                total = sum(jobs[:n], np.zeros_like(ORDERS))
                spent.setdefault(name, []).append(
                    epsilon_from_rdp(total, args.delta)[0] if n else 0.0
                )
        base = float(np.mean(counts["today"]))
        out[budget] = {}
        for name in counts:
            mean = float(np.mean(counts[name]))
            out[budget][name] = mean
            print(
                f"| {budget:g} | {name} | {mean:.2f} | {mean / base:.2f}× | "
                f"{np.mean(spent[name]):.2f} |"
            )
    alphas = ", ".join(f"{registration_order(b, args.delta):g}" for b in args.budgets)
    print(f"registration orders: {alphas} (δ = {args.delta:g})")
    return out


if __name__ == "__main__":
    main()
