"""The ledger's running sums (``ledger_total``) give the budget that composing every row gives,
to the bit, whatever happens to the jobs; the budget endpoint lists the newest rows and the
ledger endpoint pages through all of them, showing each caller what it showed before."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from core import accounting
from service import ledger, lifecycle, visibility
from service.api.datasets import EntryOut
from service.attempts import AttemptRefused, finish_attempt, start_attempt
from service.auth import Principal, authenticate
from service.db import Dataset, Job, LedgerEntry, LedgerTotal
from service.orchestration import JobState

ENDINGS = [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.LOST]


def _spec(spec, dataset: int, kind: str, rng: random.Random) -> dict[str, Any]:
    if kind == "rdp":
        epsilon = rng.choice([0.5, 1.0, 2.0])
        return spec(dataset, epsilon=epsilon, max_retries=rng.choice([0, 1]))
    epsilon = rng.choice([2.0, 3.0])
    extra = {"expected_trials": 3} if kind == "lt" else {"mean": 3, "eta": 1}
    body = spec(dataset, epsilon=epsilon, accounting=kind, **extra)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    return body


def _check(session, dataset_id: int) -> None:
    """Cached budget == all-rows budget (exactly, also as if a job were added), and only
    jobs with something outstanding have a running-sum row."""
    session.expire_all()
    dataset = session.get(Dataset, dataset_id)
    assert ledger.budget(session, dataset) == ledger.budget_from_rows(session, dataset)
    plus = np.linspace(0.0, 1.0, 2 * (len(accounting.ORDERS) + 2)) / 3  # both routes
    assert ledger.budget(session, dataset, plus) == ledger.budget_from_rows(session, dataset, plus)
    open_rows = session.execute(
        select(LedgerTotal.job_id).where(
            LedgerTotal.dataset_id == dataset_id, LedgerTotal.job_id.is_not(None)
        )
    ).scalars()
    rows = ledger.entries_of(session, dataset_id)
    outstanding = {
        job_id
        for job_id in {e.job_id for e in rows}
        if any(ledger.outstanding([e for e in rows if e.job_id == job_id])[0])
    }
    assert set(open_rows) == outstanding
    _check_counts_and_shown(session, dataset, rows)
    session.commit()


def _check_counts_and_shown(session, dataset: Dataset, rows: list[LedgerEntry]) -> None:
    """The dataset's row counts are those of its rows, and each row's shown ε is its amount
    converted at the dataset's δ."""
    kinds = dict(session.execute(select(Job.id, Job.accounting)).all())
    hidden = [
        e
        for e in rows
        if kinds.get(e.job_id) in accounting.RANDOM_STOPPING and not ledger.entry_amount(e).any()
    ]
    assert (dataset.ledger_rows, dataset.ledger_rows_hidden) == (len(rows), len(hidden))
    for e in rows:
        curves = [np.array(e.rdp)] if e.rdp is not None else []
        want = accounting.charges_epsilon(curves, [(e.epsilon, e.delta)], dataset.delta)
        if e.pld_epsilon:  # a row with a PLD pair on route B: the smaller route's
            pair = accounting.charges_epsilon([], [(e.pld_epsilon, e.pld_delta)], dataset.delta)
            want = min(want, pair)
        assert e.shown_epsilon == want, e.id


def test_random_histories_keep_the_cache_exact(api, spec, client):
    """Random jobs (rdp, lt, ps) admitted, attempted (retries, refusals) and ended every way
    (succeeded, failed, cancelled, lost); after each step the budget read from the running
    sums equals the one composed from every row."""
    rng = random.Random(20261124)
    ds = api.register(epsilon=30.0)["id"]
    ana = api.analyst(ds)
    open_jobs: list[int] = []
    with client.app.state.sessions() as session:
        for _ in range(40):
            step = rng.random()
            if step < 0.3 or not open_jobs:
                body = _spec(spec, ds, rng.choice(["rdp", "rdp", "lt", "ps"]), rng)
                r = api.client.post("/v1/jobs", headers=ana, json=body)
                assert r.status_code in (202, 409), r.text
                if r.status_code == 202:
                    open_jobs.append(r.json()["id"])
            elif step < 0.8:
                job_id = rng.choice(open_jobs)
                index = rng.choice([0, 0, 1, 2])  # 2 is outside every plan: refused
                try:
                    attempt = start_attempt(session, job_id, index, {"optimizer.lr": 0.05})
                    finish_attempt(session, attempt, rng.choice(["succeeded", "failed"]), 3)
                except AttemptRefused:
                    pass
            else:
                job_id = open_jobs.pop(rng.randrange(len(open_jobs)))
                lifecycle.apply_state(session, job_id, rng.choice(ENDINGS))
            _check(session, ds)
        for job_id in open_jobs:
            lifecycle.apply_state(session, job_id, rng.choice(ENDINGS))
            _check(session, ds)
        kinds = {e.kind for e in ledger.entries_of(session, ds)}
    assert kinds == {"reservation", "charge", "release"}
    assert api.budget(ds)["reserved"] == 0


def test_concurrent_attempts_keep_the_cache_exact(api, spec, client):
    """Admissions and attempts charged from many threads at once (each its own session, as
    the API's worker threads) serialize on the budget lock and leave the sums exact."""
    ds = api.register(epsilon=50.0)["id"]
    jobs = [
        api.client.post("/v1/jobs", headers=api.operator, json=spec(ds, max_retries=1)).json()["id"]
        for _ in range(4)
    ]
    sessions = client.app.state.sessions
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with sessions() as session:
                barrier.wait()
                for n in range(2):
                    start_attempt(session, jobs[i % 4], (i // 4 + n) % 2, {"optimizer.lr": 0.05})
                if i % 4 == 0:
                    lifecycle.apply_state(session, jobs[i % 4], JobState.FAILED)
        except AttemptRefused:
            pass
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with sessions() as session:
        charges = [e for e in ledger.entries_of(session, ds) if e.kind == "charge"]
        assert len(charges) >= 4
        _check(session, ds)


def test_budget_lists_the_newest_rows_and_ledger_pages(api, spec, session_of, dataset):
    ds = dataset["id"]
    for _ in range(3):
        jid = api.client.post("/v1/jobs", headers=api.operator, json=spec(ds)).json()["id"]
        with session_of() as session:
            lifecycle.apply_state(session, jid, JobState.CANCELLED)  # reservation, release
    c, op = api.client, api.operator
    every = c.get(f"/v1/datasets/{ds}/ledger?limit=1000", headers=op).json()
    assert every["next_after"] is None
    ids = [e["id"] for e in every["entries"]]
    assert len(ids) == 6 and ids == sorted(ids)

    budget = c.get(f"/v1/datasets/{ds}/budget?limit=4", headers=op).json()
    assert budget["entries_total"] == 6
    assert budget["entries"] == every["entries"][-4:]
    assert c.get(f"/v1/datasets/{ds}/budget", headers=op).json()["entries"] == every["entries"]

    pages, after = [], 0
    while after is not None:
        page = c.get(f"/v1/datasets/{ds}/ledger?after={after}&limit=4", headers=op).json()
        pages.append(len(page["entries"]))
        assert page["entries"] == every["entries"][sum(pages) - pages[-1] : sum(pages)]
        after = page["next_after"]
    assert pages == [4, 2]
    page = c.get(f"/v1/datasets/{ds}/ledger?after={ids[2]}&limit=3", headers=op).json()
    assert page == {"entries": every["entries"][3:], "next_after": None}

    for path, field in (
        ("budget?limit=0", "limit"),
        ("budget?limit=1001", "limit"),
        ("ledger?limit=1001", "limit"),
        ("ledger?after=-1", "after"),
        ("ledger?after=x", "after"),
    ):
        r = c.get(f"/v1/datasets/{ds}/{path}", headers=op)
        assert r.status_code == 422 and r.json()["detail"].startswith(f"{field}: "), r.text
    other = api.analyst(api.register("other")["id"])
    assert c.get(f"/v1/datasets/{ds}/ledger", headers=other).status_code == 404


def test_analysts_see_what_they_saw_before(api, spec, session_of, dataset):
    """The paged ledger and the budget's rows show an analyst exactly what
    :func:`service.visibility.ledger_entries` shows of the whole ledger: no row's owner but
    their own, no time on random-stopping rows, no zero row of a random-stopping job."""
    ds = dataset["id"]
    ana, colleague = api.analyst(ds), api.analyst(ds)
    lt = spec(ds, epsilon=1.8, accounting="lt", expected_trials=3, delta=2e-7)
    lt["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    mine = api.client.post("/v1/jobs", headers=ana, json=lt).json()["id"]
    theirs = api.client.post("/v1/jobs", headers=colleague, json=spec(ds)).json()["id"]
    with session_of() as session:
        start_attempt(session, mine, 0, {"optimizer.lr": 0.05})
        lifecycle.apply_state(session, mine, JobState.SUCCEEDED)
        start_attempt(session, theirs, 1, {"optimizer.lr": 0.2})
        lifecycle.apply_state(session, theirs, JobState.FAILED)
        # a zero release of the lt job, as versions before settle stopped writing them did
        job = session.get(Job, mine)
        ledger.append(session, job, "release", "legacy", ledger.amount(accounting.Charge()))
        session.commit()
        dataset_row = session.get(Dataset, ds)
        keys = {"ana": ana, "colleague": colleague, "operator": api.operator}
        principals = _principals(session, keys)
        expected = {}
        for who in keys:
            rows = visibility.ledger_rows(principals[who], dataset_row).order_by(LedgerEntry.id)
            views = visibility.ledger_entries(session, principals[who], dataset_row, rows)
            expected[who] = [_json(v) for v in views]
    assert len(expected["operator"]) == 6 and len(expected["ana"]) == 5
    for who, headers in keys.items():
        seen = api.client.get(f"/v1/datasets/{ds}/ledger?limit=2", headers=headers).json()
        paged, after = [], 0
        while after is not None:
            url = f"/v1/datasets/{ds}/ledger?after={after}&limit=2"
            page = api.client.get(url, headers=headers).json()
            paged += page["entries"]
            after = page["next_after"]
        assert paged == expected[who]
        assert seen["entries"] == expected[who][:2]
        budget = api.client.get(f"/v1/datasets/{ds}/budget", headers=headers).json()
        assert budget["entries"] == expected[who]
        assert budget["entries_total"] == len(expected[who])
    lt_rows = [e for e in expected["ana"] if e["job"] == mine]
    assert lt_rows and all(e["created_at"] is None for e in lt_rows)
    assert all(e["job"] in (None, mine) for e in expected["ana"])


def _principals(session, keys: dict[str, dict[str, str]]) -> dict[str, Principal]:
    secrets = {
        who: headers["Authorization"].removeprefix("Bearer ") for who, headers in keys.items()
    }
    return {who: authenticate(session, secret) for who, secret in secrets.items()}


def _json(view: visibility.EntryView) -> dict[str, Any]:
    """The row as the API writes it."""
    return EntryOut.model_validate(view, from_attributes=True).model_dump(mode="json")


@pytest.fixture
def session_of(client):
    return client.app.state.sessions


def test_rows_are_summed_exactly(api, dataset, client):
    """The sums do not depend on the order of the rows: 1 + 2⁻⁵³ + 2⁻⁵³ is not 1 (as a
    float left fold computes it) but 1 + 2⁻⁵²."""
    tiny = 2.0**-53
    vec = np.array([1.0, tiny, tiny])
    total = ledger.exact(vec[:1])[0] + ledger.exact(vec[1:2])[0] + ledger.exact(vec[2:])[0]
    assert ledger.rounded([total])[0] == 1 + 2 * tiny == 1.0 + 2.0**-52
    assert (1.0 + tiny) + tiny == 1.0  # what a float sum in row order would report
    assert ledger.rounded_up([ledger.exact(np.array([0.1]))[0] + 1])[0] == np.nextafter(0.1, 1)
    with client.app.state.sessions() as session:
        rows = session.execute(select(LedgerEntry)).scalars().all()
    assert rows == []
