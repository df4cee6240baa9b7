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
composed from its charges and outstanding reservations through the dataset's privacy filter
(``core.accounting.Filter``); admission refuses a job whose reservation would take it above
the dataset's ε.

Two routes. Every amount is kept twice. Route A is each row's curve and (ε, δ) pair: the job's
own account, from which its own ε is stated (:func:`job_charged`). Route B is what the dataset's
budget counts the job by, chosen when the job is admitted (:func:`statement`): its route A, or
one (ε, δ) pair for the whole job (its own ε at a share of the δ pairs may hold, or its second
statement, ``Charge.pld``: a fixed-K job's PLD statement, a ps job's privacy-profile bound), as
the filter picks. The dataset's spent and committed ε are route B's totals through
the dataset's privacy filter (:mod:`core.accounting.filter`: jobs are chosen after earlier
releases, so the budget must be a filter, proven at the dataset's (ε, δ)). A fixed-K job is
charged per attempt on route A; on route B, where it counts as its pair, the whole pair is
charged with its first attempt and nothing with the others (a job that never started releases
the pair). The outstanding-reservation arithmetic below works part by part on both routes
alike.

Sums are exact. Every part of the dataset's total is the exact sum of the rows' floats,
rounded once (as ``math.fsum`` rounds): it does not depend on the order the rows are added in,
so the running sums kept in ``ledger_total`` with every row (:func:`append`) give the budget
that composing all rows gives (:func:`budget_from_rows`) to the bit, and a budget read costs
one row per open job, not one per ledger row.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session

from core import accounting, shapes
from core.shapes import plan_shapes
from service.db import Dataset, Job, LedgerEntry, LedgerTotal

_N = len(accounting.ORDERS)
_W = _N + 2
"""One route's part of a ledger vector: the RDP curve over ORDERS, ε, δ."""
_ONE = 1 << 1074
"""Every finite double is an integer multiple of 2⁻¹⁰⁷⁴: in that unit, sums of ledger floats
are sums of Python integers, exact and fast."""

Exact = list[int]
"""A ledger vector in units of 2⁻¹⁰⁷⁴."""


def amount(charge: accounting.Charge, pair: tuple[float, float] | None = None) -> np.ndarray:
    """A charge as one vector: route A (its RDP curve over ORDERS, then ε, then δ), then route B
    (``pair`` alone where given: the job counted as one (ε, δ) statement; else route A again).
    Every part adds under composition (RDP by order; (ε, δ) charges by basic composition), so
    the ledger's arithmetic is vector arithmetic."""
    route = np.zeros(_W)
    if charge.rdp is not None:
        route[:_N] = charge.rdp
    if charge.eps_delta is not None:
        route[_N:] = charge.eps_delta
    return np.concatenate([route, route if pair is None else _pair(*pair)])


def statement(
    session: Session, dataset: Dataset, charge: accounting.Charge
) -> tuple[np.ndarray, Budget]:
    """The vector a job with this charge is reserved as, and the budget with it reserved. On
    route B the job counts as its curve, as its own ε stated as one (ε, δ) pair at a share of
    the δ that pairs may still hold, or as its second statement (``Charge.pld``), as the
    dataset's filter picks (:meth:`core.accounting.Filter.pick`). The choice is made from the
    ledger as it stands, before the job touches data: for the filter it is one more parameter
    chosen from what was released before. Each pair bounds the job's whole reservation, fixed
    by its plan, so it is charged whole or not at all (:func:`charge_what_ran`)."""
    rule = accounting.Filter(dataset.epsilon, dataset.delta)
    sums = _read(session, dataset)
    curve = amount(charge)
    candidates = [curve]
    delta = rule.statement_delta(sums.budget(dataset).delta_held)
    if charge.rdp is not None and delta is not None:
        own = _route_epsilon(tuple(curve[:_W].tolist()), delta)
        if math.isfinite(own):
            candidates.append(amount(charge, (own, delta)))
    if charge.pld is not None:
        candidates.append(amount(charge, charge.pld))
    after = [sums.budget(dataset, c) for c in candidates]
    options = [(c[_W : _W + _N], float(c[_W + _N]), float(c[_W + _N + 1])) for c in candidates]
    best = rule.pick(options, [b.committed for b in after])
    return candidates[best], after[best]


def _pair(epsilon: float, delta: float) -> np.ndarray:
    """One route's part that is an (ε, δ) pair alone."""
    route = np.zeros(_W)
    route[_N:] = epsilon, delta
    return route


def entry_amount(entry: LedgerEntry) -> np.ndarray:
    vec = _row_vector(entry.rdp, entry.epsilon, entry.delta)
    if entry.pld_epsilon is not None:
        vec[_W:] = _pair(entry.pld_epsilon, entry.pld_delta or 0.0)
    return vec


def _row_vector(rdp: Iterable[float] | None, epsilon: float, delta: float) -> np.ndarray:
    """A row that counts the same on both routes."""
    route = np.zeros(_W)
    if rdp is not None:
        route[:_N] = list(rdp)
    route[_N:] = epsilon, delta
    return np.concatenate([route, route])


def _route_b(vec: np.ndarray) -> tuple[float | None, float | None]:
    """How a row stores its route-B part: (None, None) where it is route A's, else its pair
    (route B's part of a row is route A's or a pair alone, as :func:`amount` and the
    per-part arithmetic of one job's rows make it)."""
    a, b = vec[:_W], vec[_W:]
    if np.array_equal(a, b):
        return None, None
    if b[:_N].any():
        raise ValueError("a ledger row's second route is its first or an (ε, δ) pair alone")
    return float(b[_N]), float(b[_N + 1])


def exact(vec: np.ndarray) -> Exact:
    """The vector's floats as exact integers (units of 2⁻¹⁰⁷⁴); a non-finite part raises."""
    return [_exact(x) for x in vec.tolist()]


def _exact(x: float) -> int:
    numerator, denominator = x.as_integer_ratio()  # the denominator is a power of 2
    return numerator << (1075 - denominator.bit_length())


def rounded(total: Exact) -> np.ndarray:
    """The exact vector rounded to floats, each part correctly rounded (Python's int / int
    is), as ``math.fsum`` of the rows it sums would give."""
    return np.array([part / _ONE for part in total])


def rounded_up(total: Exact) -> np.ndarray:
    """The exact vector rounded up to floats: the least floats not below it."""
    out = rounded(total)
    for i, (x, part) in enumerate(zip(exact(out), total, strict=True)):
        if x < part:
            out[i] = np.nextafter(out[i], np.inf)
    return out


def _add(a: Exact, b: Exact) -> Exact:
    return [x + y for x, y in zip(a, b, strict=True)]


def _sub(a: Exact, b: Exact) -> Exact:
    return [x - y for x, y in zip(a, b, strict=True)]


def _positive(vec: Exact) -> Exact:
    return [max(0, x) for x in vec]


def _zero() -> Exact:
    return [0] * (2 * _W)


def _dump(vec: Exact) -> list[list[float]]:
    """How ``ledger_total`` stores an exact vector: each part as floats whose exact sum it is
    (largest first; none for zero), so that a read decodes floats and rounds each part's
    exact total with ``math.fsum``: no big integers on the read path."""
    parts = []
    for x in vec:
        floats = []
        while x:
            f = x / _ONE
            floats.append(f)
            x -= _exact(f)
        parts.append(floats)
    return parts


def _load(parts: list[list[float]]) -> Exact:
    return [sum(_exact(f) for f in floats) for floats in parts]


def _epsilon(total: np.ndarray, delta: float) -> float:
    """A job's or a row's own ε: the smaller of its two routes' at their best orders (both
    bound the same fixed mechanisms)."""
    values = total.tolist()
    return min(_route_epsilon(tuple(values[:_W]), delta), _route_epsilon(tuple(values[_W:]), delta))


def _row_epsilon(vec: np.ndarray, delta: float) -> float:
    """A row's own ε, as shown: the smaller of its routes', but route A's where its route-B
    part is empty (a fixed-K job's later attempts: their route B was charged with the first)."""
    if not vec[_W:].any():
        return _route_epsilon(tuple(vec[:_W].tolist()), delta)
    return _epsilon(vec, delta)


@functools.lru_cache(maxsize=1024)
def _route_epsilon(total: tuple[float, ...], delta: float) -> float:
    """Memoized: dp-accounting's conversion costs as much as the rest of a read."""
    vec = np.array(total)
    curves = [vec[:_N]] if vec[:_N].any() else []
    return accounting.charges_epsilon(curves, [(total[_N], total[_N + 1])], delta)


def _dataset_epsilon(total: np.ndarray, dataset: Dataset) -> float:
    """The dataset's ε of a total: route B through the dataset's filter."""
    route = total[_W:]
    return accounting.Filter(dataset.epsilon, dataset.delta).spent(
        route[:_N], float(route[_N]), float(route[_N + 1])
    )


def append(
    session: Session, job: Job, kind: str, reference: str, vec: np.ndarray, note: str = ""
) -> LedgerEntry:
    """Write a ledger row, and bring the dataset's running sums (``ledger_total``) up to date
    in the same transaction, and the dataset's row counts. The caller holds the dataset's
    budget lock (:func:`service.db.locked_dataset`): the sums are read, changed and written
    back."""
    dataset = session.get_one(Dataset, job.dataset_id)
    pld_epsilon, pld_delta = _route_b(vec)
    entry = LedgerEntry(
        dataset_id=job.dataset_id,
        job_id=job.id,
        reference=reference,
        kind=kind,
        rdp=vec[:_N].tolist() if vec[:_N].any() else None,
        epsilon=float(vec[_N]),
        delta=float(vec[_N + 1]),
        pld_epsilon=pld_epsilon,
        pld_delta=pld_delta,
        note=note,
        shown_epsilon=_row_epsilon(vec, dataset.delta),
    )
    session.add(entry)
    dataset.ledger_rows = Dataset.ledger_rows + 1  # in SQL: the count is never read stale
    if job.accounting in accounting.RANDOM_STOPPING and not vec.any():
        dataset.ledger_rows_hidden = Dataset.ledger_rows_hidden + 1
    session.flush()
    _update_totals(session, job, entry)
    return entry


def _update_totals(session: Session, job: Job, entry: LedgerEntry) -> None:
    """Add a charge to the dataset's sum of charges, and recompute the job's outstanding
    reservation from the job's own rows (kept only while some of it is outstanding)."""
    query = select(LedgerTotal).where(
        or_(
            (LedgerTotal.dataset_id == job.dataset_id) & LedgerTotal.job_id.is_(None),
            LedgerTotal.job_id == job.id,
        )
    )
    totals = {row.job_id: row for row in session.execute(query).scalars()}
    if entry.kind == "charge":
        charges = totals.get(None) or _new_total(session, job.dataset_id, None)
        charges.amount = _dump(_add(_load(charges.amount), exact(entry_amount(entry))))
    rows = select(LedgerEntry).where(LedgerEntry.job_id == job.id)
    [left] = outstanding(session.execute(rows).scalars())
    own = totals.get(job.id)
    if any(left):
        (own or _new_total(session, job.dataset_id, job.id)).amount = _dump(left)
    elif own is not None:
        session.delete(own)
    session.flush()


def _new_total(session: Session, dataset_id: int, job_id: int | None) -> LedgerTotal:
    row = LedgerTotal(dataset_id=dataset_id, job_id=job_id, amount=_dump(_zero()))
    session.add(row)
    return row


@dataclass(frozen=True)
class Budget:
    epsilon: float  # the dataset's lifetime budget ...
    delta: float  # ... at this δ
    spent: float  # ε of all charges (route B through the dataset's filter)
    committed: float  # ε of charges plus outstanding reservations (the same)
    #: δ held by the (ε, δ) statements the budget counts (Liu–Talwar bounds, caps on K,
    #: profile and PLD statements), committed: of the filter's ``pair_delta``, what is not
    #: free for later statements
    delta_held: float

    @property
    def reserved(self) -> float:
        """What the outstanding reservations add to ``spent`` (ε does not add linearly under
        RDP composition, so this is a difference of composed totals)."""
        return self.committed - self.spent

    @property
    def remaining(self) -> float:
        return self.epsilon - self.committed


def rows_of(dataset_id: int) -> Select[tuple[LedgerEntry]]:
    """The query of the dataset's ledger rows, in id order."""
    return select(LedgerEntry).where(LedgerEntry.dataset_id == dataset_id).order_by(LedgerEntry.id)


def entries_of(session: Session, dataset_id: int) -> list[LedgerEntry]:
    return list(session.execute(rows_of(dataset_id)).scalars())


def budget(session: Session, dataset: Dataset, plus: np.ndarray | None = None) -> Budget:
    """The dataset's budget state, optionally as if ``plus`` were reserved as well."""
    return _read(session, dataset).budget(dataset, plus)


@dataclass(frozen=True)
class _Snapshot:
    """The dataset's running sums as one read found them: the charges, rounded, and the floats
    of every part of what is committed (charges and outstanding reservations)."""

    spent: np.ndarray
    parts: list[list[float]]

    def budget(self, dataset: Dataset, plus: np.ndarray | None = None) -> Budget:
        """The budget, as if ``plus`` were reserved as well."""
        extra = [0.0] * len(self.parts) if plus is None else plus.tolist()
        committed = [math.fsum([x, *floats]) for x, floats in zip(extra, self.parts, strict=True)]
        return _budget(dataset, self.spent, np.array(committed))


def _read(session: Session, dataset: Dataset) -> _Snapshot:
    """The dataset's running sums: one query, one row per open job. In one statement, so that
    on PostgreSQL (read committed) the charges and the reservations come from the same
    snapshot."""
    query = select(LedgerTotal.job_id, LedgerTotal.amount).where(
        LedgerTotal.dataset_id == dataset.id
    )
    charges: list[list[float]] = [[] for _ in range(2 * _W)]
    parts: list[list[float]] = [[] for _ in charges]
    for job_id, amount in session.execute(query):
        if job_id is None:
            charges = amount
        for mine, theirs in zip(parts, amount, strict=True):
            mine.extend(theirs)
    return _Snapshot(np.array([math.fsum(floats) for floats in charges]), parts)


def budget_from_rows(session: Session, dataset: Dataset, plus: np.ndarray | None = None) -> Budget:
    """:func:`budget` composed from every ledger row of the dataset: the definition that the
    running sums must match exactly (the tests and ``bench/ledger_reads.py`` compare them)."""
    sums = _Sums.of(entries_of(session, dataset.id))
    committed = sums.charges
    for vec in [*sums.outstanding(), *([] if plus is None else [exact(plus)])]:
        committed = _add(committed, vec)
    return _budget(dataset, rounded(sums.charges), rounded(committed))


def _budget(dataset: Dataset, spent: np.ndarray, committed: np.ndarray) -> Budget:
    """The budget from the rounded sums of the charges and of everything committed."""
    return Budget(
        epsilon=dataset.epsilon,
        delta=dataset.delta,
        spent=_dataset_epsilon(spent, dataset),
        committed=_dataset_epsilon(committed, dataset),
        delta_held=float(committed[_W + _N + 1]),
    )


@dataclass
class _Sums:
    """Exact sums over ledger rows: the charges, and per job reserved − charged − released."""

    charges: Exact
    signed: dict[int | None, Exact]

    @classmethod
    def of(cls, entries: Iterable[LedgerEntry]) -> _Sums:
        sums = cls(_zero(), defaultdict(_zero))
        for entry in entries:
            sums.add(entry)
        return sums

    def add(self, entry: LedgerEntry) -> Exact:
        """Add a row; returns its job's signed sum before it."""
        vec = exact(entry_amount(entry))
        if entry.kind == "charge":
            self.charges = _add(self.charges, vec)
        before = self.signed[entry.job_id]
        combine = _add if entry.kind == "reservation" else _sub
        self.signed[entry.job_id] = combine(before, vec)
        return before

    def outstanding(self) -> list[Exact]:
        """Each job's outstanding reservation, max(0, reserved − charged − released)."""
        return [_positive(vec) for vec in self.signed.values()]


def outstanding(entries: Iterable[LedgerEntry]) -> list[Exact]:
    """Each job's outstanding reservation over these rows, exactly."""
    return _Sums.of(entries).outstanding()


def running_totals(entries: list[LedgerEntry], dataset: Dataset) -> list[tuple[float, float]]:
    """(spent, committed) ε of the ledger up to and including each row, in the rows' order:
    the budget as it stood after each row was written, composed as :func:`budget` composes
    the whole ledger (its last pair is ``budget``'s ``spent`` and ``committed``)."""
    sums = _Sums.of([])
    outstanding = _zero()  # the sum of the jobs' outstanding reservations
    totals = []
    for entry in entries:
        before = sums.add(entry)
        after = sums.signed[entry.job_id]
        outstanding = _add(_sub(outstanding, _positive(before)), _positive(after))
        committed = rounded(_add(sums.charges, outstanding))
        spent = _dataset_epsilon(rounded(sums.charges), dataset)
        totals.append((spent, _dataset_epsilon(committed, dataset)))
    return totals


def job_charged(session: Session, job: Job) -> float:
    """ε of the job's charges, composed and stated at the job's own δ (comparable with its
    plan's ε): what the job has cost so far."""
    query = select(LedgerEntry).where(LedgerEntry.job_id == job.id, LedgerEntry.kind == "charge")
    sums = _Sums.of(session.execute(query).scalars())
    return _epsilon(rounded(sums.charges), job.plan["delta"])


def entry_epsilon(entry: Any, delta: float) -> float:
    """One row's own ε at the dataset's δ (for display; totals are composed, not summed): the
    one written with it, or for a row written before revision 0008, from its curve. ``entry``
    is a :class:`LedgerEntry` or a result row with its ``shown_epsilon``, ``rdp``, ``epsilon``
    and ``delta``."""
    if entry.shown_epsilon is not None:
        return float(entry.shown_epsilon)
    curve = tuple(entry.rdp) if entry.rdp is not None else None
    return _curve_epsilon(curve, entry.epsilon, entry.delta, delta)


@functools.lru_cache(maxsize=4096)
def _curve_epsilon(
    curve: tuple[float, ...] | None, epsilon: float, row_delta: float, delta: float
) -> float:
    """Memoized for the rows written before revision 0008, shown from their curves on every
    read (a job's charges, and jobs planned alike, share their amounts)."""
    return _row_epsilon(_row_vector(curve, epsilon, row_delta), delta)


def charge_what_ran(session: Session, job: Job) -> list[LedgerEntry]:
    """Append a charge for everything the job has run that is not charged yet, and return all
    of the job's rows. Idempotent: each charge has its own reference.

    What counts as having run: every recorded trial attempt (the attempt row is written before
    the attempt reads data, :mod:`service.attempts`), each charged one trial (and on route B,
    where the job is stated there as one pair, the whole pair with the first, which is charged
    in the transaction that records it); under random stopping (``lt``, ``ps``) the whole
    bound, once the job started at all (invariant 3).
    """
    query = select(LedgerEntry).where(LedgerEntry.job_id == job.id).order_by(LedgerEntry.id)
    entries = list(session.execute(query).scalars())
    references = {e.reference for e in entries}
    reservation = next(e for e in entries if e.kind == "reservation")
    reserved = entry_amount(reservation)
    # a fixed-K job stated as one pair on route B: the pair with its first charge, then nothing
    own_pair = reservation.pld_epsilon is not None and not tuning_method(job).random_stopping
    first = not any(e.kind == "charge" for e in entries)
    for reference, vec, note in _charges_due(job, reserved):
        if reference not in references:
            if own_pair:
                vec[_W:] = reserved[_W:] if first else 0.0
            first = False
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
    is outstanding, so settling again writes nothing. (The row's floats are the exact rest
    rounded up, so that nothing of it stays outstanding.)"""
    [rest] = outstanding(charge_what_ran(session, job))
    if not any(rest):
        return
    left = rounded_up(rest)
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
    return [
        (
            f"job:{job.id}:trial:{t.index}:attempt:{a.number}",
            amount(accounting.Charge(rdp=attempt_rdp(job, t.params))),
            "trial attempt",
        )
        for t, a in attempts
    ]


def tuning_method(job: Job) -> accounting.TuningMethod:
    """How the job's trials are charged, as its plan stored it."""
    return accounting.tuning_method(job.plan["method"])


def attempt_rdp(job: Job, params: dict[str, Any]) -> np.ndarray:
    """The RDP curve of one attempt of the candidate ``params``: its shape's, from the job's
    stored plan (:mod:`core.shapes`)."""
    plan = job.plan
    return shapes.shape_curve(shapes.shape_of(plan_shapes(plan), params), plan["validation_noise"])
