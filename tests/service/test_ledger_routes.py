"""The ledger's two routes: random histories of jobs — rdp with and without a PLD statement,
lt, ps with its privacy-profile bound — reserved (each counted on route B by its curve or its
pair, as admission chooses), attempted and settled through the ledger's own functions. After
every step: the running sums give the all-rows budget to the bit, the spent and committed ε are
route B's totals through the dataset's filter as recomputed here from the rows (exact fractions,
dp-accounting's conversion at the one order), and a fixed-K job's PLD pair is charged on route
B at most once, whatever its retries."""

from __future__ import annotations

import math
import uuid
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import select

from core import accounting
from core.accounting import PAIR_DELTA_SHARE, LiuTalwar, PapernotSteinke, Rdp, TrialMechanism
from core.shapes import Shape
from service import ledger
from service.db import ApiKey, Dataset, Job, LedgerEntry, Trial, TrialAttempt

N = len(accounting.ORDERS)
DELTA, BUDGET = 1e-5, 10.0
Q, STEPS = 0.1, 20
SIGMAS = (1.0, 2.0, 4.0)
KINDS = ("rdp", "rdp_pld", "lt", "ps")


def method_of(kind: str, trials: int, pld_delta: float) -> accounting.TuningMethod:
    match kind:
        case "rdp":
            return Rdp(trials=trials)
        case "rdp_pld":
            return Rdp(trials=trials, pld_delta=pld_delta)
        case "lt":
            return LiuTalwar(gamma=0.5, delta2=DELTA / 20)
    return PapernotSteinke(mean=3.0, eta=1.0, max_trials=100, profile_delta=DELTA / 10)


def new_job(session, dataset: Dataset, owner: int, kind: str, sigma: float, trials: int) -> Job:
    """A job of one shape, as the planner plans it, and its reservation as admission chooses
    it (checked against the filter's rule, recomputed here). A PLD statement takes half the δ
    pairs may still hold, or all of the dataset's where none is left (as an analyst's δ may):
    the pair is then over-held, and the curve counts."""
    trial = TrialMechanism(sample_rate=Q, noise_multiplier=sigma, steps=STEPS)
    free = PAIR_DELTA_SHARE * DELTA - ledger.budget(session, dataset).delta_held
    method = method_of(kind, trials, free / 2 if free > 0 else DELTA)
    delta = DELTA / 10 if kind == "lt" else DELTA
    shape = Shape(
        batch_size=10,
        epochs=2.0,
        sample_rate=Q,
        steps=STEPS,
        noise_multiplier=sigma,
        gradient_noise_multiplier=sigma,
        trial_epsilon=trial.epsilon(delta)[0],
    )
    plan = {
        "method": method.model_dump(),
        "delta": delta,
        "shapes": [shape.model_dump()],
        "validation_noise": None,
        "attempts_reserved": trials,
    }
    job = Job(
        dataset_id=dataset.id,
        owner_key_id=owner,
        request_sha256="0" * 64,
        spec={},
        plan=plan,
        accounting=kind.removesuffix("_pld"),
    )
    session.add(job)
    session.flush()
    charge = method.charge(trial.rdp(), delta, BUDGET, [trial])
    free = PAIR_DELTA_SHARE * DELTA - ledger.budget(session, dataset).delta_held
    pairs = [charge.pld] if charge.pld else []
    if charge.rdp is not None and free > 0:
        own = (
            free / 2,
            accounting.charges_epsilon([charge.rdp], [charge.eps_delta or (0, 0)], free / 2),
        )
        pairs.append(own[::-1])
    vec, after = ledger.statement(session, dataset, charge)
    # the job counts as its curve or one of its pairs: of those that fit, the one that takes
    # least of the room the conversion leaves (a curve: its RDP at the order; a pair: its ε)
    [i] = np.flatnonzero(accounting.filter_order(BUDGET, DELTA) == accounting.ORDERS)
    curve_share = (charge.rdp[i] if charge.rdp is not None else 0.0) + (charge.eps_delta or (0,))[0]
    options = [(ledger.amount(charge), curve_share)] + [
        (ledger.amount(charge, p), p[0]) for p in pairs
    ]
    fitting = [
        (share, option)
        for option, share in options
        if ledger.budget(session, dataset, option).committed <= BUDGET
    ]
    if fitting:
        assert after.committed <= BUDGET
        chosen = min(share for share, _ in fitting)
        assert any((vec == option).all() and share == chosen for share, option in fitting)
    ledger.append(session, job, "reservation", f"job:{job.id}:reservation", vec)
    return job


def attempt(session, job: Job) -> None:
    """One more attempt (a retry of trial 0 or a new trial), charged as the service does."""
    if len([a for t in job.trials for a in t.attempts]) >= job.plan["attempts_reserved"]:
        return  # refused (service.attempts): the reservation does not cover it
    trial = job.trials[0] if job.trials and len(job.trials[0].attempts) < 2 else None
    if trial is None:
        trial = Trial(job_id=job.id, index=len(job.trials), params={})
        session.add(trial)
        job.trials.append(trial)
    trial.attempts.append(TrialAttempt(number=len(trial.attempts) + 1))
    session.flush()
    ledger.charge_what_ran(session, job)


def routes(rows: list[LedgerEntry]) -> tuple[list[Fraction], list[Fraction]]:
    """Exact sums of the rows per route: charges, and charges plus outstanding reservations,
    each as one vector (route A then route B), rebuilt from the columns without the ledger."""
    charges = [Fraction(0)] * (2 * (N + 2))
    signed: dict[int | None, list[Fraction]] = {}
    for row in rows:
        a = [*(row.rdp or [0.0] * N), row.epsilon, row.delta]
        b = a if row.pld_epsilon is None else [0.0] * N + [row.pld_epsilon, row.pld_delta]
        vec = [Fraction(x) for x in [*a, *b]]
        if row.kind == "charge":
            charges = [x + y for x, y in zip(charges, vec, strict=True)]
        sign = 1 if row.kind == "reservation" else -1
        before = signed.get(row.job_id, [Fraction(0)] * len(vec))
        signed[row.job_id] = [x + sign * y for x, y in zip(before, vec, strict=True)]
    committed = charges
    for vec in signed.values():
        committed = [x + max(Fraction(0), y) for x, y in zip(committed, vec, strict=True)]
    return charges, committed


def filtered_epsilon(vec: list[Fraction]) -> float:
    """Route B through the filter, by dp-accounting's conversion at the dataset's one order."""
    floats = np.array([float(x) for x in vec])  # each part correctly rounded
    if floats[N + 1] > PAIR_DELTA_SHARE * DELTA:
        return math.inf
    if not floats[:N].any():
        return float(floats[N])
    [i] = np.flatnonzero(accounting.filter_order(BUDGET, DELTA) == accounting.ORDERS)
    at, _ = rdp_lib.compute_epsilon([accounting.ORDERS[i]], [floats[i]], 0.9 * DELTA)
    return float(at + floats[N])


def check(session, dataset: Dataset, jobs: list[Job]) -> None:
    cached = ledger.budget(session, dataset)
    assert cached == ledger.budget_from_rows(session, dataset)
    plus = np.linspace(0.0, 1.0, 2 * (N + 2)) / 7
    assert ledger.budget(session, dataset, plus) == ledger.budget_from_rows(session, dataset, plus)
    rows = ledger.entries_of(session, dataset.id)
    charges, committed = routes(rows)
    for total, got in ((charges, cached.spent), (committed, cached.committed)):
        assert got == pytest.approx(filtered_epsilon(total[N + 2 :]), rel=1e-12, abs=1e-12)
    assert cached.delta_held == float(committed[2 * (N + 2) - 1])
    for job in jobs:  # a fixed-K job's PLD pair: charged on route B once at most
        own = [r for r in rows if r.job_id == job.id]
        reservation = own[0]
        if job.accounting != "rdp" or reservation.pld_epsilon is None:
            continue
        pairs = [r.pld_epsilon for r in own if r.kind == "charge" and r.pld_epsilon]
        assert pairs in ([], [reservation.pld_epsilon])


ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.sampled_from(KINDS),
            st.sampled_from(SIGMAS),
            st.integers(1, 3),
        ),
        st.tuples(st.just("attempt"), st.integers(0, 7)),
        st.tuples(st.just("end"), st.integers(0, 7), st.booleans()),
    ),
    min_size=1,
    max_size=14,
)


@hypothesis_settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=ACTIONS)
def test_the_committed_epsilon_is_route_b_through_the_filter(
    client, actions: list[tuple[Any, ...]]
) -> None:
    with client.app.state.sessions() as session:
        owner = session.execute(select(ApiKey.id)).scalars().first()
        dataset = Dataset(
            name=f"routes-{uuid.uuid4().hex}",
            source="builtin:digits",
            n=1000,
            num_classes=10,
            input_shape=[64],
            public_validation=False,
            epsilon=BUDGET,
            delta=DELTA,
            content_sha256="0" * 64,
        )
        session.add(dataset)
        session.flush()
        jobs: list[Job] = []
        open_jobs: list[Job] = []
        for action in actions:
            if action[0] == "admit":
                job = new_job(session, dataset, owner, *action[1:])
                jobs.append(job)
                open_jobs.append(job)
            elif open_jobs and action[0] == "attempt":
                attempt(session, open_jobs[action[1] % len(open_jobs)])
            elif open_jobs:
                job = open_jobs.pop(action[1] % len(open_jobs))
                ledger.settle(session, job, charge_reservation=action[2])
            session.flush()
            check(session, dataset, jobs)
        for job in open_jobs:
            ledger.settle(session, job)
            check(session, dataset, jobs)
        settled = ledger.budget(session, dataset)
        assert settled.committed == settled.spent
        session.rollback()
