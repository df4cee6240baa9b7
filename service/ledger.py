"""The privacy-budget ledger (docs/design.md, invariant 2, 3 and 7).

Rows are append-only and each has a unique reference. Kinds:

- ``reservation``: a job's full planned cost, written in the transaction that admits it;
- ``charge``: privacy actually consumed (an attempt that touched data, or a random-stopping
  job's whole bound once it started);
- ``release``: the part of a reservation returned when the job is settled — only what never
  touched data (no row when nothing is left: a random-stopping job that started).

A job's outstanding reservation is max(0, reserved − charged − released), order by order
(per RDP order, and for ε and δ); while a job is open its commitment is therefore
max(reserved, charged), and once settled it is exactly its charges. A dataset's committed ε is
recomputed from all rows with ``core.accounting.dataset_epsilon``; admission refuses a job
whose reservation would take it above the dataset's ε.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from core import accounting
from service.db import Dataset, Job, LedgerEntry

_N = len(accounting.ORDERS)


def amount(charge: accounting.Charge) -> np.ndarray:
    """A charge as one vector: its RDP curve over ORDERS, then ε, then δ. Every part adds
    under composition (RDP by order; (ε, δ) charges by basic composition), so the ledger's
    arithmetic is vector arithmetic."""
    vec = np.zeros(_N + 2)
    if charge.rdp is not None:
        vec[:_N] = charge.rdp
    if charge.eps_delta is not None:
        vec[_N:] = charge.eps_delta
    return vec


def entry_amount(entry: LedgerEntry) -> np.ndarray:
    vec = np.zeros(_N + 2)
    if entry.rdp is not None:
        vec[:_N] = entry.rdp
    vec[_N:] = entry.epsilon, entry.delta
    return vec


def _epsilon(amounts: list[np.ndarray], delta: float) -> float:
    total = np.sum(list(amounts), axis=0) if amounts else np.zeros(_N + 2)
    curves = [total[:_N]] if total[:_N].any() else []
    return accounting.dataset_epsilon(curves, [(float(total[_N]), float(total[_N + 1]))], delta)


def append(
    session: Session, job: Job, kind: str, reference: str, vec: np.ndarray, note: str = ""
) -> LedgerEntry:
    entry = LedgerEntry(
        dataset_id=job.dataset_id,
        job_id=job.id,
        reference=reference,
        kind=kind,
        rdp=vec[:_N].tolist() if vec[:_N].any() else None,
        epsilon=float(vec[_N]),
        delta=float(vec[_N + 1]),
        note=note,
    )
    session.add(entry)
    return entry


@dataclass(frozen=True)
class Budget:
    epsilon: float  # the dataset's lifetime budget ...
    delta: float  # ... at this δ
    spent: float  # ε of all charges
    committed: float  # ε of charges plus outstanding reservations
    delta_held: float  # δ held by (ε, δ) charges (Liu–Talwar bounds, caps on K), committed
    entries: list[LedgerEntry]

    @property
    def reserved(self) -> float:
        """What the outstanding reservations add to ``spent`` (ε does not add linearly under
        RDP composition, so this is a difference of composed totals)."""
        return self.committed - self.spent

    @property
    def remaining(self) -> float:
        return self.epsilon - self.committed


def entries_of(session: Session, dataset_id: int) -> list[LedgerEntry]:
    query = select(LedgerEntry).where(LedgerEntry.dataset_id == dataset_id)
    return list(session.execute(query.order_by(LedgerEntry.id)).scalars())


def budget(session: Session, dataset: Dataset, plus: np.ndarray | None = None) -> Budget:
    """The dataset's budget state, optionally as if ``plus`` were reserved as well."""
    entries = entries_of(session, dataset.id)
    charges = [entry_amount(e) for e in entries if e.kind == "charge"]
    outstanding = _outstanding(entries)
    if plus is not None:
        outstanding.append(plus)
    return Budget(
        epsilon=dataset.epsilon,
        delta=dataset.delta,
        spent=_epsilon(charges, dataset.delta),
        committed=_epsilon(charges + outstanding, dataset.delta),
        delta_held=float(sum(vec[_N + 1] for vec in charges + outstanding)),
        entries=entries,
    )


def _outstanding(entries: list[LedgerEntry]) -> list[np.ndarray]:
    per_job: dict[int | None, np.ndarray] = defaultdict(lambda: np.zeros(_N + 2))
    for e in entries:
        sign = 1 if e.kind == "reservation" else -1
        per_job[e.job_id] = per_job[e.job_id] + sign * entry_amount(e)
    return [np.maximum(vec, 0) for vec in per_job.values()]


def running_totals(entries: list[LedgerEntry], delta: float) -> list[tuple[float, float]]:
    """(spent, committed) ε of the ledger up to and including each row, in the rows' order:
    the budget as it stood after each row was written, composed as :func:`budget` composes
    the whole ledger (its last pair is ``budget``'s ``spent`` and ``committed``)."""
    charges = np.zeros(_N + 2)
    per_job: dict[int | None, np.ndarray] = defaultdict(lambda: np.zeros(_N + 2))
    totals = []
    for e in entries:
        vec = entry_amount(e)
        if e.kind == "charge":
            charges = charges + vec
        per_job[e.job_id] = per_job[e.job_id] + (1 if e.kind == "reservation" else -1) * vec
        outstanding = np.sum([np.maximum(v, 0) for v in per_job.values()], axis=0)
        totals.append((_epsilon([charges], delta), _epsilon([charges, outstanding], delta)))
    return totals


def job_charged(session: Session, job: Job) -> float:
    """ε of the job's charges, composed and stated at the job's own δ (comparable with its
    plan's ε): what the job has cost so far."""
    query = select(LedgerEntry).where(LedgerEntry.job_id == job.id, LedgerEntry.kind == "charge")
    return _epsilon([entry_amount(e) for e in session.execute(query).scalars()], job.plan["delta"])


def entry_epsilon(entry: LedgerEntry, delta: float) -> float:
    """One row's own ε at the dataset's δ (for display; totals are composed, not summed)."""
    return _epsilon([entry_amount(entry)], delta)


def charge_what_ran(session: Session, job: Job) -> list[LedgerEntry]:
    """Append a charge for everything the job has run that is not charged yet, and return all
    of the job's rows. Idempotent: each charge has its own reference.

    What counts as having run: every recorded trial attempt (the attempt row is written before
    the attempt reads data, :mod:`service.attempts`), each charged one trial; under random
    stopping (``lt``, ``ps``) the whole bound, once the job started at all (invariant 3).
    """
    query = select(LedgerEntry).where(LedgerEntry.job_id == job.id).order_by(LedgerEntry.id)
    entries = list(session.execute(query).scalars())
    references = {e.reference for e in entries}
    reservation = next(e for e in entries if e.kind == "reservation")
    for reference, vec, note in _charges_due(job, entry_amount(reservation)):
        if reference not in references:
            entries.append(append(session, job, "charge", reference, vec, note))
    return entries


def settle(session: Session, job: Job, *, charge_reservation: bool = False) -> None:
    """Finalize a terminated job's ledger: charge whatever ran, then release the rest of its
    reservation — only what provably never touched data. With ``charge_reservation`` (a job
    whose fate is unknown) the rest is charged instead. The caller commits.

    Only a row that carries an amount is written. A random-stopping job that started was
    charged its whole bound then, so nothing of it is left: a zero row written now would be
    dated by the job's end, which depends on how many trials ran (invariant 11). This also
    makes settling idempotent without a marker row: once settled, nothing of the reservation
    is outstanding, so settling again writes nothing."""
    left = _outstanding(charge_what_ran(session, job))[0]
    if not left.any():
        return
    if charge_reservation:
        append(
            session,
            job,
            "charge",
            f"job:{job.id}:unaccounted",
            left,
            "job lost: the rest of its reservation is charged",
        )
    else:
        append(session, job, "release", f"job:{job.id}:release", left, "unused reservation")


def _charges_due(job: Job, reservation: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    """(reference, amount, note) of every charge the job has incurred so far."""
    attempts = [(t, a) for t in job.trials for a in t.attempts]
    if tuning_method(job).random_stopping:
        started = job.started_at is not None or attempts
        return [(f"job:{job.id}:bound", reservation, "random-stopping bound")] if started else []
    trial = amount(accounting.Charge(rdp=trial_rdp(job)))
    return [
        (f"job:{job.id}:trial:{t.index}:attempt:{a.number}", trial, "trial attempt")
        for t, a in attempts
    ]


def tuning_method(job: Job) -> accounting.TuningMethod:
    """How the job's trials are charged, as its plan stored it."""
    return accounting.tuning_method(job.plan["method"])


def trial_rdp(job: Job) -> np.ndarray:
    """One trial's RDP curve, recomputed from the job's stored plan."""
    plan = job.plan
    return accounting.TrialMechanism(
        sample_rate=plan["sample_rate"],
        noise_multiplier=plan["noise_multiplier"],
        steps=plan["steps"],
        validation_noise=plan["validation_noise"],
    ).rdp()
