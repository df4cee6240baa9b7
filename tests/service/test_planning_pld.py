"""Fixed-K (``rdp``) jobs stated by PLD, through the real HTTP API (issue 41): the planner
calibrates σ against the smaller of RDP and the PLD of the job's composition, and the ledger
admits such a job by its second route, on which its whole PLD statement is charged once."""

from __future__ import annotations

from typing import Any

import pytest

from core.accounting import Rdp, TrialMechanism, calibrate_noise, epsilon_from_rdp
from core.shapes import Shape, shape_curve
from service.attempts import start_attempt

DELTA = 1e-5


def digits_cnn(dataset: int, epsilon: float = 2.0, **privacy: Any) -> dict[str, Any]:
    """One trial of the cnn on digits, B = 256, 20 epochs, a public selection score."""
    return {
        "dataset": dataset,
        "model": {"name": "cnn"},
        "method": {"clipping": "abadi", "threshold": 1.0},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "validation": {"split": "public"},
        "epochs": 20,
        "batch_size": 256,
        "search_space": {},
        "privacy": {"epsilon": epsilon, "accounting": "rdp", **privacy},
    }


def plan(api, body: dict[str, Any]) -> dict[str, Any]:
    r = api.client.post("/v1/plans", headers=api.operator, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_issues_digits_example_is_calibrated_by_pld(api) -> None:
    """σ 4.25 by RDP at ε = 2, δ = 1e-5 (the dataset's δ), about 3.94 by the PLD stated at the
    same δ; the plan says which bound states the job, and its ε is that bound's."""
    ds = api.register(epsilon=2.0, delta=DELTA)["id"]
    planned = plan(api, digits_cnn(ds))
    q, steps, sigma = planned["sample_rate"], planned["steps"], planned["noise_multiplier"]
    assert planned["method"] == {"kind": "rdp", "trials": 1, "pld_delta": DELTA}
    assert planned["bound"] == "pld" and planned["delta"] == DELTA
    assert calibrate_noise(q, steps, 2.0, DELTA, Rdp(trials=1)) == pytest.approx(4.25, abs=0.02)
    assert sigma == pytest.approx(3.94, abs=0.02)
    trial = TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps)
    assert planned["epsilon"] == Rdp(trials=1, pld_delta=DELTA).pld_epsilon(DELTA, [trial])
    assert 2.0 * (1 - 1e-3) <= planned["epsilon"] <= 2.0
    assert epsilon_from_rdp(trial.rdp(), DELTA)[0] > 2.1  # RDP alone would refuse it
    assert planned["fits"] and planned["remaining_epsilon_after"] >= 0


def test_a_budget_of_two_admits_one_pld_job_and_refuses_a_second(api, client) -> None:
    """Attack: the dataset's budget is ε = 2. The ε = 2 PLD-calibrated job fits by route B
    (route A, its RDP curve, is above 2); a second such job is refused; the first job's
    retries and later attempts never add to route B (its spent ε stays its statement)."""
    ds = api.register(epsilon=2.0, delta=DELTA)["id"]
    body = digits_cnn(ds, max_retries=2)
    first = api.client.post("/v1/jobs", headers=api.operator, json=body)
    assert first.status_code == 202, first.text
    job = first.json()
    stated = job["plan"]["epsilon"]
    assert job["plan"]["bound"] == "pld"
    assert api.budget(ds)["remaining"] == pytest.approx(2.0 - stated, abs=1e-12)
    second = api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds))
    assert second.status_code == 409, second.text

    [shape] = job["plan"]["shapes"]
    curve = shape_curve(Shape.model_validate(shape), None)
    with client.app.state.sessions() as session:
        for n in range(3):  # the trial and both its retries
            start_attempt(session, job["id"], 0, {})
            budget = api.budget(ds)
            by_rdp = epsilon_from_rdp((n + 1) * curve, DELTA)[0]
            assert budget["spent"] == pytest.approx(min(by_rdp, stated), rel=1e-12)
            assert budget["spent"] <= stated and budget["spent"] + budget["reserved"] <= 2.0
    assert api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds)).status_code == 409


def test_several_shapes_are_stated_by_rdp_alone(api) -> None:
    ds = api.register(epsilon=20.0, delta=DELTA)["id"]
    body = digits_cnn(ds)
    body["search_space"] = {"batch_size": {"grid": [128, 256]}}
    planned = plan(api, body)
    assert planned["method"]["pld_delta"] is None and planned["bound"] == "rdp"


def test_route_b_full_leaves_later_jobs_to_rdp(api) -> None:
    """The first job's statement holds all of route B's δ; a later job's default is then RDP
    alone (its plan's ε is what it costs on route A), and lt's default δ is as before."""
    ds = api.register(epsilon=20.0, delta=DELTA)["id"]
    first = api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds))
    assert first.json()["plan"]["method"]["pld_delta"] == DELTA
    later = plan(api, digits_cnn(ds))
    assert later["method"]["pld_delta"] is None and later["bound"] == "rdp"
    assert later["noise_multiplier"] == pytest.approx(4.25, abs=0.02)
    lt = digits_cnn(ds, accounting="lt", expected_trials=2)
    assert plan(api, lt)["delta"] == pytest.approx(DELTA / 10, rel=1e-12)
