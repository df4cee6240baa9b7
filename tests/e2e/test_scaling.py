"""Cheap trials, then one final run (Panda et al., ICML 2024) through the product: a real Ray
head, real HTTP, real training."""

from __future__ import annotations

import json

import pytest

from core.accounting import epsilon_from_rdp, rdp_curve

from .conftest import OPERATOR, small_job
from .test_jobs import through_filter


def test_a_scaling_job_releases_its_final_run_and_is_charged_every_run(service, digits) -> None:
    """Two learning rates at two cheap levels, then the final run at the extrapolated lr: the
    released model is the final run's, the ledger charged each attempt its own level's curve
    and the job's PLD statement (the plan's ε, below the curves' sum), and the analyst's trial
    views show each run's level, lr and score, the final run's with the fitted line."""
    spec = small_job(digits) | {
        "search_space": {"optimizer.lr": {"grid": [0.05, 0.5]}},
        "scaling": {},
    }
    secret = service.post("/v1/keys", {"name": "ana", "role": "analyst", "datasets": [digits]})
    analyst = {"Authorization": f"Bearer {secret['secret']}"}
    job = service.post("/v1/jobs", spec, analyst)
    plan = job["plan"]
    assert plan["trials"]["max"] == 5 and len(plan["shapes"]) == 3
    done = service.wait(job["id"], timeout=120)
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]

    trials = service.get(f"/v1/jobs/{job['id']}/trials", analyst)
    cheap = sorted((t["params"]["scaling.level"], t["params"]["optimizer.lr"]) for t in trials)[:4]
    final_epsilon = plan["scaling"]["final"]["epsilon"]
    scaled = [
        (i, lr * level["epsilon"] / final_epsilon)
        for i, level in enumerate(plan["scaling"]["levels"])
        for lr in (0.05, 0.5)
    ]  # each level runs the searched rates scaled down by its share of the final run's ε
    assert [level for level, _ in cheap] == [level for level, _ in scaled]
    assert [lr for _, lr in cheap] == pytest.approx([lr for _, lr in scaled], rel=1e-12)
    levels = sorted(t["params"]["scaling.level"] for t in trials)
    assert levels == [0, 0, 1, 1, 2]
    assert all(t["score"] is not None for t in trials)
    [final] = [t for t in trials if t["params"]["scaling.level"] == 2]
    assert final["released"] and sum(t["released"] for t in trials) == 1
    steps = plan["shapes"][-1]["steps"]
    fit = final["params"]
    assert fit["scaling.r"] == pytest.approx(
        fit["scaling.slope"] * plan["scaling"]["final"]["epsilon"]
    )
    # lr = r/T: the levels' picks as final rates, averaged with weights ε², so within the grid
    assert final["params"]["optimizer.lr"] == pytest.approx(fit["scaling.r"] / steps)
    assert 0.05 * (1 - 1e-9) <= final["params"]["optimizer.lr"] <= 0.5 * (1 + 1e-9)

    budget = service.get(f"/v1/datasets/{digits}/budget")
    charges = [e for e in budget["entries"] if e["kind"] == "charge"]
    assert len(charges) == 5
    curves = [
        rdp_curve(s["sample_rate"], s["noise_multiplier"], s["steps"])
        for t in trials
        for s in plan["shapes"]
        if s["level"] == t["params"]["scaling.level"]
    ]
    # the plan composes every run (RDP, or PLD where smaller); the dataset counts the job by
    # its curves through its filter or as one pair (charged with the first run), whichever
    # was lower when it was admitted: at least the job's ε, at most its curves' count
    by_rdp = epsilon_from_rdp(sum(curves), 1e-5)[0]
    assert 0.99 * 2.0 <= plan["epsilon"] <= min(by_rdp, 2.0)
    assert plan["epsilon"] <= budget["spent"] <= through_filter(sum(curves)) * (1 + 1e-9)

    response = service.client.get(f"/v1/jobs/{job['id']}/model", headers=OPERATOR)
    assert response.status_code == 200
    size = int.from_bytes(response.content[:8], "little")
    config = json.loads(json.loads(response.content[8 : 8 + size])["__metadata__"]["config"])
    assert config["optimizer"]["lr"] == pytest.approx(final["params"]["optimizer.lr"])
    assert config["noise_multiplier"] == plan["scaling"]["final"]["noise_multiplier"]
