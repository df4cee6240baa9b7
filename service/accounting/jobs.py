"""One entry point for "what does this job cost?", whatever the accounting method.

A *trial* is T steps of DP-SGD (q, σ) plus, optionally, other mechanisms on the same data
whose RDP is passed as ``extra_rdp`` (e.g. a private validation score, DESIGN.md
invariant 5). A *job* is several trials charged by one of :data:`METHODS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.accounting import checks
from service.accounting.rdp import compose, epsilon_from_rdp, rdp_curve
from service.accounting.tuning import cap_delta, liu_talwar, ps_epsilon, trials_tail, tuning_rdp

#: accounting method -> (required parameters, optional parameters with defaults)
METHODS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "single": ((), {}),
    "rdp": (("trials",), {}),
    "lt": (("gamma", "delta2"), {}),
    "ps": (("mean",), {"eta": None, "max_trials": None}),
}


def method_params(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Check that ``params`` are exactly what ``method`` takes; fill in the optional ones."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    required, optional = METHODS[method]
    for name in required:
        if params.get(name) is None:
            raise ValueError(f"{name} is required for method {method!r}")
    unknown = set(params) - set(required) - set(optional)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]} is not a parameter of method {method!r}")
    return {**optional, **params}


def trial_rdp(
    sample_rate: float, noise_multiplier: float, steps: int, extra_rdp: np.ndarray | None = None
) -> np.ndarray:
    """RDP curve of one trial: its DP-SGD steps composed with ``extra_rdp``."""
    curve = rdp_curve(sample_rate, noise_multiplier, steps)
    return curve if extra_rdp is None else compose(curve, extra_rdp)


@dataclass(frozen=True)
class Charge:
    """What a job costs, in the ledger's two currencies (DESIGN.md invariant 7): an RDP curve
    and/or an (ε, δ) pair composed basically."""

    rdp: np.ndarray | None = None
    eps_delta: tuple[float, float] | None = field(default=None)


def job_charge(
    trial: np.ndarray,
    delta: float,
    method: str,
    *,
    statement_epsilon: float | None = None,
    **params: Any,
) -> Charge:
    """The ledger charge of a job whose every trial has RDP curve ``trial``.

    ``rdp`` and ``ps`` charges are RDP curves, so they compose tightly with the dataset's other
    charges; ``lt`` is an (ε, δ) statement (Liu & Talwar, "Private Selection from Private
    Candidates", STOC 2019, as paper 001 Thm. 1 states it) and is charged as one.

    A ``ps`` cap on K (Papernot & Steinke, ICLR 2022, bound the uncapped job) is charged as
    (0, (1 + e^ε_D)·t), t = P[K > cap]. The ledger does not state this job on its own: it
    composes every job's curve and states the whole dataset at its composed ε_D, at the
    dataset's δ less the (ε, δ) charges' δs (DESIGN.md invariant 7). Capping this job moves the
    whole composed transcript by at most t in total variation, which costs (1 + e^ε_D)·t at that
    statement (:func:`~service.accounting.tuning.cap_delta`), not (1 + e^ε_job)·t: ε_D can be
    larger than the job's own ε. ε_D is not known when the job is admitted (later jobs add to
    it), so ``statement_epsilon`` must be an upper bound on it that always holds — the
    dataset's lifetime budget ε, above which admission refuses any job (invariant 2).
    """
    p = method_params(method, params)
    if method == "single":
        return Charge(rdp=trial)
    if method == "rdp":
        return Charge(rdp=checks.count("trials", p["trials"]) * trial)
    if method == "lt":
        bound = liu_talwar(trial, delta, p["gamma"], p["delta2"])
        return Charge(eps_delta=(bound.epsilon, bound.delta))
    curve = tuning_rdp(trial, p["mean"], p["eta"])
    if p["max_trials"] is None:
        return Charge(rdp=curve)
    if statement_epsilon is None:
        raise ValueError("statement_epsilon (the dataset's budget ε) is required to charge a "
                         "cap on K")
    tail = trials_tail(p["mean"], p["eta"], checks.count("max_trials", p["max_trials"]))
    return Charge(rdp=curve, eps_delta=(0.0, cap_delta(tail, statement_epsilon)))


def job_epsilon(trial: np.ndarray, delta: float, method: str, **params: Any) -> float:
    """ε of a job at its overall δ."""
    p = method_params(method, params)
    if method == "lt":
        return liu_talwar(trial, delta, p["gamma"], p["delta2"]).epsilon
    if method == "ps":
        return ps_epsilon(trial, delta, p["mean"], p["eta"], p["max_trials"])
    return epsilon_from_rdp(job_charge(trial, delta, method, **p).rdp, delta)[0]


def tuning_epsilon(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    method: str,
    *,
    extra_rdp: np.ndarray | None = None,
    **params: Any,
) -> float:
    """ε at overall δ of a tuning job whose trials each run ``steps`` DP-SGD steps (q, σ).

    ``method="rdp"``: ``trials=K`` fixed trials composed. ``method="lt"``: ``gamma``, ``delta2``
    (Liu–Talwar, paper 001 Thm. 1). ``method="ps"``: ``mean`` and ``eta`` (None: K ~
    Poisson(mean); else truncated negative binomial, η = 1 geometric), optional ``max_trials``.
    """
    checks.probability("delta", delta)
    method_params(method, params)
    return job_epsilon(trial_rdp(sample_rate, noise_multiplier, steps, extra_rdp), delta,
                       method, **params)


def dataset_epsilon(
    rdp_curves: list[np.ndarray],
    eps_delta_charges: list[tuple[float, float]],
    delta: float,
) -> float:
    """Spent ε of a dataset from all its ledger charges (DESIGN.md invariant 7).

    RDP curves add (composition), and the sum is converted at what is left of the dataset's δ
    once the (ε, δ) charges' δs are subtracted; those charges' εs then add by basic
    composition (Dwork–Roth Thm. 3.16). Returns ``inf`` when the δs alone exceed the budget.
    """
    d = checks.probability("delta", delta)
    eps = sum(e for e, _ in eps_delta_charges)
    d_left = d - sum(dd for _, dd in eps_delta_charges)
    if not rdp_curves:
        return float(eps) if d_left >= 0 else math.inf
    if d_left <= 0:
        return math.inf
    return epsilon_from_rdp(compose(*rdp_curves), d_left)[0] + eps
