"""Fixed-K (``rdp``) jobs stated by PLD, through the real HTTP API (issue 41): the planner
calibrates σ against the smaller of RDP and the PLD of the job's composition; the dataset's
filter counts a job as one (ε, δ) pair where that leaves it the most, charged once."""

from __future__ import annotations

from typing import Any

import pytest

from core.accounting import (
    PAIR_DELTA_SHARE,
    Rdp,
    TrialMechanism,
    calibrate_noise,
    epsilon_from_rdp,
)
from core.shapes import Shape, shape_curve
from service.attempts import start_attempt

DELTA = 1e-5
POOL = PAIR_DELTA_SHARE * DELTA  # the δ that (ε, δ) statements may hold


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
    """σ 4.25 by RDP at ε = 2, δ = 1e-5, about 3.94 by the PLD stated at the same δ (the job's δ
    given in the spec); the plan says which bound states the job, and its ε is that bound's.
    Left to the planner, the PLD statement's δ is half of what pairs may hold on the dataset
    (5e-7), where the PLD is above RDP: RDP states the job."""
    ds = api.register(epsilon=20.0, delta=DELTA)["id"]
    planned = plan(api, digits_cnn(ds, delta=DELTA))
    q, steps, sigma = planned["sample_rate"], planned["steps"], planned["noise_multiplier"]
    assert planned["method"] == {"kind": "rdp", "trials": 1, "pld_delta": DELTA}
    assert planned["bound"] == "pld" and planned["delta"] == DELTA
    assert calibrate_noise(q, steps, 2.0, DELTA, Rdp(trials=1)) == pytest.approx(4.25, abs=0.02)
    assert sigma == pytest.approx(3.94, abs=0.02)
    trial = TrialMechanism(sample_rate=q, noise_multiplier=sigma, steps=steps)
    assert planned["epsilon"] == Rdp(trials=1, pld_delta=DELTA).pld_epsilon(DELTA, [trial])
    assert 2.0 * (1 - 1e-3) <= planned["epsilon"] <= 2.0
    assert epsilon_from_rdp(trial.rdp(), DELTA)[0] > 2.1  # RDP alone would need more noise
    assert planned["fits"] and planned["remaining_epsilon_after"] >= 0

    default = plan(api, digits_cnn(ds))
    assert default["method"]["pld_delta"] == pytest.approx(POOL / 2, rel=1e-12)
    assert default["bound"] == "rdp"
    assert default["noise_multiplier"] == pytest.approx(4.25, abs=0.02)


def test_retries_never_cost_more_than_the_job_counts(api, client, filter_epsilon) -> None:
    """Attack: retries must not take a job above what the dataset counted when it admitted
    it. Here the job (three attempts reserved) counts as its curve at the dataset's order: each
    attempt spends one trial's curve through the filter, the commitment never moves, and a
    second job that does not fit is refused."""
    ds = api.register(epsilon=2.0, delta=DELTA)["id"]
    body = digits_cnn(ds, epsilon=1.8, max_retries=2)
    first = api.client.post("/v1/jobs", headers=api.operator, json=body)
    assert first.status_code == 202, first.text
    job = first.json()
    counted = 2.0 - api.budget(ds)["remaining"]
    assert job["plan"]["epsilon"] < counted < 2.0
    assert api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds)).status_code == 409

    [shape] = job["plan"]["shapes"]
    curve = shape_curve(Shape.model_validate(shape), None)
    assert counted == pytest.approx(filter_epsilon(2.0, DELTA, 3 * curve), rel=1e-9)
    with client.app.state.sessions() as session:
        for n in range(3):  # the trial and both its retries
            start_attempt(session, job["id"], 0, {})
            budget = api.budget(ds)
            spent = filter_epsilon(2.0, DELTA, (n + 1) * curve)
            assert budget["spent"] == pytest.approx(spent, rel=1e-9)
            assert budget["spent"] + budget["reserved"] == pytest.approx(counted, rel=1e-9)
    assert api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds)).status_code == 409


def test_several_shapes_are_stated_by_rdp_alone(api) -> None:
    ds = api.register(epsilon=20.0, delta=DELTA)["id"]
    body = digits_cnn(ds)
    body["search_space"] = {"batch_size": {"grid": [128, 256]}}
    planned = plan(api, body)
    assert planned["method"]["pld_delta"] is None and planned["bound"] == "rdp"


def test_statements_take_half_of_what_pairs_may_still_hold(api) -> None:
    """Each (ε, δ) statement's default δ is half of the δ that pairs may hold and do not hold
    yet, so later statements still fit; what a job counted as its curve holds nothing."""
    ds = api.register(epsilon=20.0, delta=DELTA)["id"]
    first = api.client.post("/v1/jobs", headers=api.operator, json=digits_cnn(ds)).json()
    assert first["plan"]["method"]["pld_delta"] == pytest.approx(POOL / 2, rel=1e-12)
    held = sum(e["delta"] for e in api.budget(ds)["entries"])
    assert held in (0.0, pytest.approx(POOL / 2, rel=1e-12))  # its curve, or one pair
    later = plan(api, digits_cnn(ds))
    assert later["method"]["pld_delta"] == pytest.approx((POOL - held) / 2, rel=1e-12)
    lt = digits_cnn(ds, accounting="lt", expected_trials=2)
    assert plan(api, lt)["delta"] == pytest.approx((POOL - held) / 2, rel=1e-12)
