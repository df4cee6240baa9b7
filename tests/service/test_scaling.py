"""Cheap trials, then one final run (Panda et al., ICML 2024): the spec's ``scaling``, its plan
(one shape per level, the final run's last) and what each attempt is charged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.accounting import ORDERS, PAIR_DELTA_SHARE
from core.shapes import plan_shapes, reserved_attempts, shape_of
from core.spec import JobSpec
from service.api import create_app

from .conftest import OPERATOR_KEY, Api, bearer, make_spec
from .test_runner_api import RecordingOrchestrator


def _scaling_spec(dataset: int = 1, **extra: Any) -> dict[str, Any]:
    """A tiny scaling job: two learning rates at two default levels, then the final run."""
    spec = make_spec(dataset, 2.0) | {"model": {"name": "logreg"}, "scaling": {}}
    spec["search_space"] = {"optimizer.lr": {"grid": [0.05, 0.5]}}
    return spec | extra


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"privacy": {"epsilon": 2.0, "accounting": "ps", "mean": 3, "eta": 1}}, "scaling"),
        ({"privacy": {"epsilon": 2.0, "accounting": "lt", "gamma": 0.5}}, "scaling"),
        ({"proxy": 7}, "proxy"),
        (
            {
                "search_space": {
                    "optimizer.lr": {"grid": [0.1, 1.0]},
                    "method.threshold": {"grid": [0.5, 1.0]},
                }
            },
            "search_space.method.threshold",
        ),
        (
            {"search_space": {"optimizer.lr": {"grid": [0.1]}, "batch_size": {"grid": [32, 64]}}},
            "search_space.batch_size",
        ),
        ({"search_space": {}}, "search_space.optimizer.lr"),
        (
            {
                "search_space": {"optimizer.lr": {"values": [0.1, 1.0]}},
                "privacy": {"epsilon": 2.0, "accounting": "rdp", "trials": 2},
            },
            "search_space.optimizer.lr",
        ),
        ({"scaling": {"levels": [0.4, 0.2]}}, "scaling.levels"),
        ({"scaling": {"levels": [0.2, 0.2]}}, "scaling.levels"),
        ({"scaling": {"levels": [0.1, 0.2], "share": 0.3}}, "scaling.share"),
        ({"scaling": {"levels": [0.1]}}, "levels"),
        ({"scaling": {"share": 1.0}}, "share"),
        ({"scaling": {"steps": 3}}, "steps"),
    ],
)
def test_bad_combinations_are_refused_naming_the_field(change, field):
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(_scaling_spec(**change))
    assert field in str(refused.value)


@pytest.mark.parametrize(
    ("scaling", "space", "trials", "count"),
    [
        ({}, {"grid": [0.05, 0.5]}, None, 5),
        ({"levels": [0.1, 0.2, 0.4]}, {"grid": [0.05, 0.5]}, None, 7),
        ({}, {"log_uniform": [0.01, 1.0]}, 3, 7),
    ],
)
def test_the_runs_are_every_candidate_at_each_level_then_the_final(scaling, space, trials, count):
    privacy = {"epsilon": 2.0, "accounting": "rdp"} | ({"trials": trials} if trials else {})
    job = JobSpec.model_validate(
        _scaling_spec(scaling=scaling, search_space={"optimizer.lr": space}, privacy=privacy)
    )
    assert job.trial_count() == count


def _accountant_epsilon(
    plan: dict[str, Any], runs: list[tuple[float, int]], accountant: Any, delta: float
) -> float:
    """The job's ε from one of dp-accounting's own accountants: each (σ, count) run composed
    count times, every run T steps of the Poisson-subsampled Gaussian and its validation
    score's Gaussian."""
    [q] = {s["sample_rate"] for s in plan["shapes"]}
    [steps] = {s["steps"] for s in plan["shapes"]}
    for sigma, count in runs:
        run = dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps
                ),
                dp_event.GaussianDpEvent(plan["validation_noise"]),
            ]
        )
        accountant.compose(run, count)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(
    ("scaling", "retries"), [({}, 0), ({"share": 0.3}, 1), ({"levels": [0.2, 0.5]}, 0)]
)
def test_plan_composes_every_run_to_the_target(api, dataset, ana, scaling, retries):
    """The plan's ε is the composition of all runs (each level's C·(1 + retries), the final
    run's 1 + retries) by the smaller of RDP and PLD, as dp-accounting's own accountants
    compose them (its PLD accountant on a finer grid, so a little below ours), at or just below
    the target; the reservation carries both; each level's σ is findable from a run's
    parameters."""
    privacy = {"epsilon": 2.0, "accounting": "rdp", "max_retries": retries}
    body = _scaling_spec(dataset["id"], scaling=scaling, privacy=privacy)
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    attempts = 1 + retries
    levels, final = plan["scaling"]["levels"], plan["scaling"]["final"]
    assert [lv["trials"] for lv in levels] == [2, 2] and final["trials"] == 1
    runs = [(lv["noise_multiplier"], lv["trials"] * attempts) for lv in levels]
    runs.append((final["noise_multiplier"], attempts))
    delta = plan["delta"]
    by_rdp = _accountant_epsilon(plan, runs, rdp_lib.RdpAccountant(list(ORDERS)), delta)
    pld_delta = plan["method"]["pld_delta"]  # half of what pairs may hold on the dataset
    assert pld_delta == pytest.approx(PAIR_DELTA_SHARE * delta / 2, rel=1e-12)
    by_pld = _accountant_epsilon(plan, runs, pld_lib.PLDAccountant(), pld_delta)
    assert min(by_pld, by_rdp) <= plan["epsilon"] <= min(1.01 * by_pld, by_rdp)
    assert plan["bound"] == ("rdp" if plan["epsilon"] == by_rdp else "pld")
    assert 0.99 * 2.0 <= plan["epsilon"] <= 2.0
    assert plan["attempts_reserved"] == 5 * attempts and plan["trials"]["max"] == 5
    sigmas = [lv["noise_multiplier"] for lv in levels]
    assert sigmas == sorted(sigmas, reverse=True) and final["noise_multiplier"] < sigmas[-1]
    if "levels" in scaling:
        for level, want in zip(levels, scaling["levels"], strict=True):
            assert 0.999 * want <= level["epsilon"] <= want
        assert "scaling.levels" not in plan["defaults"]
    else:
        assert {"scaling.levels", "scaling.share"} & plan["defaults"].keys()
        share = scaling.get("share", 0.5)
        assert plan["scaling"]["cheap_epsilon"] == pytest.approx(share * 2.0, rel=2e-3)
    shapes = plan_shapes(plan)
    for level, lv in enumerate([*levels, final]):
        shape = shape_of(shapes, {"optimizer.lr": 0.05, "scaling.level": level})
        assert shape.noise_multiplier == lv["noise_multiplier"]
        assert reserved_attempts(plan, shape) == lv["trials"] * attempts
    with pytest.raises(ValueError, match="selects 0"):
        shape_of(shapes, {"optimizer.lr": 0.05})  # a run that names no level is no run


def test_the_reservation_is_the_plans_composition(api, dataset, ana):
    """What admission reserves is the plan's composition of all runs, not K times the
    costliest run's curve."""
    body = _scaling_spec(dataset["id"])
    r = api.client.post("/v1/jobs", headers=ana, json=body)
    assert r.status_code in (201, 202), r.text
    plan = r.json()["plan"]
    reserved = api.budget(dataset["id"])["reserved"]  # through the dataset's filter
    assert plan["epsilon"] <= reserved < 0.9 * plan["trials"]["max"] * plan["trial_epsilon"]


@pytest.mark.parametrize(
    ("scaling", "field"),
    [({"levels": [0.5, 2.5]}, "scaling.levels"), ({"levels": [1.5, 1.9]}, "scaling.levels")],
)
def test_levels_the_budget_cannot_pay_are_refused(api, dataset, ana, scaling, field):
    body = _scaling_spec(dataset["id"], scaling=scaling)
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 422, r.text
    assert field in r.text


@pytest.fixture
def runs(settings) -> Iterator[tuple[Api, RecordingOrchestrator]]:
    orchestrator = RecordingOrchestrator()
    with TestClient(create_app(settings, orchestrator)) as client:
        yield Api(client, bearer(OPERATOR_KEY)), orchestrator


def test_the_runner_cannot_run_a_level_more_often_than_reserved(runs):
    """Attack: a runner's token recording cheap trials as final runs (the costliest level),
    or a run that names no level, is refused before it touches data; a run of a level is
    charged that level's curve; only the final run's model may be released."""
    api, orchestrator = runs
    dataset = api.register()["id"]
    r = api.client.post("/v1/jobs", headers=api.operator, json=_scaling_spec(dataset))
    assert r.status_code == 202, r.text
    job = r.json()
    auth = bearer(orchestrator.submitted[job["id"]].token)
    base = f"/internal/v1/jobs/{job['id']}"

    def start(index: int, **params: Any) -> Any:
        body = {"index": index, "params": {"optimizer.lr": 0.05, **params}}
        return api.client.post(f"{base}/attempts", headers=auth, json=body)

    assert start(0).status_code == 409  # no level: no planned σ
    assert start(0, **{"scaling.level": 3}).status_code == 409  # no such level
    first = start(0, **{"scaling.level": 2})
    assert first.status_code == 201, first.text
    again = start(1, **{"scaling.level": 2})  # the plan reserved one final run
    assert again.status_code == 409, again.text
    assert start(1, **{"scaling.level": 0}).status_code == 201
    assert start(3, **{"scaling.level": 0}).status_code == 201  # every lr runs at each level
    assert start(4, **{"scaling.level": 0}).status_code == 409  # but no more
    finish = {"status": "succeeded", "steps": 22, "score": 0.9}
    attempt = start(2, **{"scaling.level": 1}).json()["attempt"]
    api.client.post(f"{base}/attempts/{attempt}/finish", headers=auth, json=finish)
    upload = api.client.put(f"{base}/trials/2/model", headers=auth, content=b"x")
    assert upload.status_code == 409 and "best finished" in upload.text  # a cheap run
    entries = api.client.get(f"/v1/datasets/{dataset}/ledger", headers=api.operator).json()
    charges = [e["epsilon"] for e in entries["entries"] if e["kind"] == "charge"]
    levels = job["plan"]["shapes"]
    want = [levels[i]["trial_epsilon"] for i in (2, 0, 0, 1)]
    want[0] = min(want[0], job["plan"]["epsilon"])  # the first also carries the PLD statement
    assert charges == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    ("share", "epsilon", "split"), [(0.9, 100.0, "private"), (0.05, 0.5, "public")]
)
def test_a_loose_or_tight_share_is_planned(api, dataset, ana, share, epsilon, split):
    """At ε = 100 a share of 0.9 lets the cheap levels run at the smallest σ the planner uses;
    a share of 0.05 at ε = 0.5 gives them a large one. Either way the job lands on its target."""
    body = _scaling_spec(dataset["id"], scaling={"share": share})
    body["privacy"]["epsilon"] = epsilon
    body["validation"] = {"split": split} | ({"noise": 20.0} if split == "private" else {})
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert 0.99 * epsilon <= plan["epsilon"] <= epsilon
    assert plan["scaling"]["cheap_epsilon"] <= share * epsilon * 1.002


def test_a_share_the_validation_scores_alone_exceed_is_refused(api, dataset, ana):
    body = _scaling_spec(dataset["id"], scaling={"share": 0.05})
    body["privacy"]["epsilon"] = 0.5  # 4 private scores at noise 20 cost more than 0.025
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 422 and "scaling.share" in r.text, r.text
    assert "private validation scores alone" in r.text


def test_a_share_too_small_for_its_runs_is_refused_saying_so(api, dataset, ana):
    """With public validation no score costs ε: what a share of 0.01 of ε = 0.05 cannot pay
    for is the 8 runs at each level (2 candidates, 3 retries each) even at the largest σ."""
    body = _scaling_spec(dataset["id"], scaling={"share": 0.01})
    body["privacy"] = {"epsilon": 0.05, "accounting": "rdp", "max_retries": 3}
    body["validation"] = {"split": "public"}
    r = api.client.post("/v1/plans", headers=ana, json=body)
    assert r.status_code == 422, r.text
    [error] = r.json()["errors"]
    assert error["field"] == "scaling.share"
    assert "8 runs at each level are too many" in error["message"]
    assert "validation" not in error["message"]


@pytest.mark.parametrize("database_url", [None], ids=["sqlite"])  # planning reads no rows
@hypothesis_settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    epsilon=st.floats(0.05, 100.0),
    share=st.floats(0.01, 0.99),
    retries=st.integers(0, 3),
    split=st.sampled_from(["public", "private"]),
)
def test_any_scaling_plan_lands_at_its_target_or_names_the_field(
    api, dataset, ana, epsilon, share, retries, split, database_url
):
    """Whatever the analyst's numbers, the job's statement — the smaller of RDP and PLD, whose
    cost jumps back to RDP's where PLD is not computed — is calibrated to at most its target
    and at least 0.99 of it, or the plan is refused naming the field at fault."""
    body = _scaling_spec(dataset["id"], scaling={"share": share})
    body["privacy"] = {"epsilon": epsilon, "accounting": "rdp", "max_retries": retries}
    body["validation"] = {"split": split} | ({"noise": 20.0} if split == "private" else {})
    r = api.client.post("/v1/plans", headers=ana, json=body)
    if r.status_code == 422:
        assert {e["field"] for e in r.json()["errors"]} <= {"scaling.share", "privacy.epsilon"}
        return
    assert r.status_code == 200, r.text
    plan = r.json()
    assert 0.99 * epsilon <= plan["epsilon"] <= epsilon
    assert plan["bound"] in {"pld", "rdp"}
