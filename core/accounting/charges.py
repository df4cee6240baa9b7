"""What the ledger composes: charges in its two currencies, and the ε of fixed charges.

A *trial* is T steps of DP-SGD (q, σ) plus, optionally, other mechanisms on the same data
whose RDP is passed as ``extra_rdp`` (e.g. a private validation score, docs/design.md
invariant 5); a job's charge comes from its tuning method (:mod:`core.accounting.methods`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from core.accounting import checks
from core.accounting.rdp import compose, epsilon_from_rdp, rdp_curve


def trial_rdp(
    sample_rate: float, noise_multiplier: float, steps: int, extra_rdp: np.ndarray | None = None
) -> np.ndarray:
    """RDP curve of one trial: its DP-SGD steps composed with ``extra_rdp``."""
    curve = rdp_curve(sample_rate, noise_multiplier, steps)
    return curve if extra_rdp is None else compose(curve, extra_rdp)


@dataclass(frozen=True)
class Charge:
    """What a job costs, in the ledger's two currencies (docs/design.md, invariant 7): an RDP curve
    and/or an (ε, δ) pair composed basically. ``pld``, where there is one, is a second sound
    statement of the same whole job as one (ε, δ) pair (a fixed-K job's PLD statement, a ps job's
    privacy-profile bound): the dataset's filter may count the job as that pair in place of the
    rest (``service.ledger.statement``)."""

    rdp: np.ndarray | None = None
    eps_delta: tuple[float, float] | None = field(default=None)
    pld: tuple[float, float] | None = field(default=None)


def charges_epsilon(
    rdp_curves: list[np.ndarray],
    eps_delta_charges: list[tuple[float, float]],
    delta: float,
) -> float:
    """ε at δ of fixed charges composed: a job's or a ledger row's own statement (a dataset's
    budget, whose jobs are chosen after earlier releases, is a filter instead:
    :mod:`core.accounting.filter`).

    RDP curves add (composition), and the sum is converted at its best order at what is left
    of δ once the (ε, δ) charges' δs are subtracted; those charges' εs then add by basic
    composition (Dwork–Roth Thm. 3.16). Returns ``inf`` when the δs alone exceed δ.
    """
    d = checks.probability("delta", delta)
    eps = sum(e for e, _ in eps_delta_charges)
    d_left = d - sum(dd for _, dd in eps_delta_charges)
    if not rdp_curves:
        return float(eps) if d_left >= 0 else math.inf
    if d_left <= 0:
        return math.inf
    return epsilon_from_rdp(compose(*rdp_curves), d_left)[0] + eps
