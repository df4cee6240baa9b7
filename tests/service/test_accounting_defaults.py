"""The documented privacy defaults, through the real HTTP API (GitHub issue 17, items 4, 6).

- Item 6: rdp, lt and ps jobs submitted with their defaults (no ``privacy.delta``, ``delta2``
  or ``max_trials``) are all admitted on a dataset whose budget fits them, in every order.
- Item 4: a ps cap on K costs (1 + e^ε)·P[K > cap] of δ — in the ledger at the dataset's budget
  ε, in the job's own statement at the job's ε — and the default cap is the smallest that keeps
  that at most δ/100. Each number is recomputed here from the closed form of the tail.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
from scipy.stats import poisson
from sqlalchemy import select

from core.accounting import PAIR_DELTA_SHARE, epsilon_from_rdp, gaussian_rdp, rdp_curve, tuning_rdp
from core.accounting.profile import profile_epsilon
from service.db import LedgerEntry

BUDGET, DELTA = 20.0, 1e-5  # the dataset's lifetime budget
JOB_EPSILON = 2.0
MEAN = 3  # E[K] of ps jobs
PRIVACY: dict[str, dict[str, Any]] = {
    "rdp": {"accounting": "rdp"},
    "lt": {"accounting": "lt", "expected_trials": MEAN},
    "ps": {"accounting": "ps", "mean": MEAN, "eta": 1},
}
DEFAULTED = {  # the spec fields each method leaves to the planner
    "rdp": {"privacy.delta"},
    "lt": {"privacy.delta", "privacy.delta2"},
    "ps": {"privacy.delta", "privacy.max_trials"},
}


def job_body(
    spec: Callable[..., dict[str, Any]], dataset: int, accounting: str, **privacy: Any
) -> dict[str, Any]:
    body = spec(dataset, epsilon=JOB_EPSILON, **{**PRIVACY[accounting], **privacy})
    body["epochs"] = 0.5
    if accounting != "rdp":  # random stopping draws candidates from a prior, no grids
        body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    return body


POOL = PAIR_DELTA_SHARE * DELTA  # the δ that (ε, δ) statements may hold


def delta_held(api, dataset: int) -> float:
    """δ the dataset's (ε, δ) statements hold (no job here has run yet, so every row is a
    reservation)."""
    return sum(e["delta"] for e in api.budget(dataset)["entries"])


def submit(api, spec, dataset: int, accounting: str, **privacy: Any) -> dict[str, Any]:
    r = api.client.post(
        "/v1/jobs", headers=api.operator, json=job_body(spec, dataset, accounting, **privacy)
    )
    assert r.status_code == 202, r.text
    return r.json()["plan"]


@pytest.mark.parametrize("order", list(itertools.permutations(PRIVACY)))
def test_defaults_fit_in_any_order(api, spec, order: tuple[str, ...]) -> None:
    dataset = api.register(epsilon=BUDGET, delta=DELTA)["id"]
    for accounting in order:
        held = delta_held(api, dataset)
        plan = submit(api, spec, dataset, accounting)
        assert set(plan["defaults"]) == DEFAULTED[accounting]
        if accounting == "lt":  # half of what (ε, δ) statements may hold and do not yet
            assert plan["delta"] == pytest.approx((POOL - held) / 2, rel=1e-12)
            assert plan["method"]["delta2"] == pytest.approx(plan["delta"] / 2, rel=1e-12)
        else:
            assert plan["delta"] == DELTA
        assert 0 < api.budget(dataset)["remaining"] < BUDGET
    assert delta_held(api, dataset) < POOL


def test_lt_jobs_at_default_delta_keep_fitting(api, spec) -> None:
    dataset = api.register(epsilon=BUDGET, delta=DELTA)["id"]
    deltas = [submit(api, spec, dataset, "lt")["delta"] for _ in range(3)]
    assert deltas == pytest.approx([POOL / 2**i for i in range(1, 4)], rel=1e-12)
    submit(api, spec, dataset, "rdp")  # curves still have δ to be converted at
    assert math.isfinite(api.budget(dataset)["remaining"])


def geometric_tail(cap: int) -> float:
    return (1 - 1 / MEAN) ** cap  # K ~ Geometric(1/mean) on {1, 2, …}


def poisson_tail(cap: int) -> float:
    return float(poisson.sf(cap, MEAN))


@pytest.mark.parametrize(("eta", "tail"), [(1, geometric_tail), ("poisson", poisson_tail)])
def test_default_cap_and_its_charge(api, spec, eta: Any, tail: Callable[[int], float]) -> None:
    dataset = api.register(epsilon=BUDGET, delta=DELTA)["id"]
    plan = submit(api, spec, dataset, "ps", eta=eta)
    cap = plan["method"]["max_trials"]
    assert plan["trials"]["max"] == cap

    def cost(k: int) -> float:
        return (1 + math.exp(BUDGET)) * tail(k)

    assert cost(cap) <= DELTA / 100 < cost(cap - 1)  # the smallest such cap
    with api.client.app.state.sessions() as session:  # the job's own account: route A
        (reservation,) = session.execute(select(LedgerEntry)).scalars()
    if plan["bound"] == "profile":  # the privacy-profile bound's (ε, δ) charges it, cap inside
        trial = (plan["sample_rate"], plan["noise_multiplier"], plan["steps"])
        d = plan["method"]["profile_delta"]
        assert (reservation.epsilon, reservation.delta) == pytest.approx((plan["epsilon"], d))
        by_profile = profile_epsilon(((*trial, plan["validation_noise"]),), d, MEAN, 1.0, tail(cap))
        assert plan["epsilon"] == pytest.approx(by_profile, rel=1e-12)
        return
    assert reservation.delta == pytest.approx(cost(cap), rel=1e-9)

    # The job's own (ε, δ): ε ≥ ε_rdp(δ − (1 + e^ε)·t), and no smaller ε is.
    trial = rdp_curve(plan["sample_rate"], plan["noise_multiplier"], plan["steps"]) + gaussian_rdp(
        plan["validation_noise"]
    )
    curve = tuning_rdp(trial, MEAN, None if eta == "poisson" else 1.0)
    eps, t = plan["epsilon"], tail(cap)
    assert eps >= epsilon_from_rdp(curve, DELTA - (1 + math.exp(eps)) * t)[0]
    below = eps * (1 - 1e-6)
    assert below < epsilon_from_rdp(curve, DELTA - (1 + math.exp(below)) * t)[0]


def test_a_cap_whose_cost_leaves_no_delta_is_refused(api, spec) -> None:
    dataset = api.register(epsilon=BUDGET, delta=DELTA)["id"]
    cap = 40  # P[K > 40] = 9e-8 < δ, but (1 + e^20)·9e-8 ≈ 44 > δ
    assert geometric_tail(cap) < DELTA < (1 + math.exp(BUDGET)) * geometric_tail(cap)
    r = api.client.post(
        "/v1/jobs", headers=api.operator, json=job_body(spec, dataset, "ps", max_trials=cap)
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("privacy.max_trials:")
    assert api.budget(dataset)["entries"] == []
