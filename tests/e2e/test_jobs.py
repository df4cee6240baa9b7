"""POST → trials on Ray → charged ε → released model → budget, with a real Ray cluster."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from safetensors import safe_open
from sklearn.datasets import load_digits

from core.accounting import (
    ORDERS,
    PAIR_DELTA_SHARE,
    Rdp,
    TrialMechanism,
    epsilon_from_rdp,
    filter_order,
    gaussian_rdp,
    rdp_curve,
    tuning_epsilon,
    tuning_rdp,
)
from core.config import DatasetConfig, ModelConfig
from service.api import create_app
from service.orchestration import JobState
from workers.data import load_dataset
from workers.metrics import evaluate
from workers.models import build_model

from .conftest import (
    OPERATOR,
    OPERATOR_ENV,
    environment,
    long_job,
    small_job,
    trial_processes,
)


def charged(budget: dict) -> list[dict]:
    return [e for e in budget["entries"] if e["kind"] == "charge"]


def safe_open_metadata(blob: bytes) -> dict[str, str]:
    """A safetensors file's metadata: its header is 8 bytes of length, then JSON."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size])["__metadata__"]


def composed_trials(plan: dict, trials: int) -> float:
    """The ε of ``trials`` trials of the plan, recomputed from the plan's numbers alone."""
    return tuning_epsilon(
        plan["sample_rate"],
        plan["noise_multiplier"],
        plan["steps"],
        plan["delta"],
        "rdp",
        trials=trials,
    )


def at_order(curve: np.ndarray, budget: float = 10.0, delta: float = 1e-5) -> float:
    """The curve's RDP at the order the dataset's filter reads (docs/privacy.md)."""
    [i] = np.flatnonzero(filter_order(budget, delta) == ORDERS)
    return float(curve[i])


def through_filter(curve: np.ndarray, budget: float = 10.0, delta: float = 1e-5) -> float:
    """The dataset's ε of a curve alone under its privacy filter: dp-accounting's conversion at
    the dataset's one order, at the δ that pairs may not hold (docs/privacy.md)."""
    order = filter_order(budget, delta)
    d = (1 - PAIR_DELTA_SHARE) * delta
    return float(rdp_lib.compute_epsilon([order], [at_order(curve, budget, delta)], d)[0])


def spent_on(plan: dict, attempts: int, validation_noise: float | None = None) -> float:
    """What ``attempts`` attempts of the plan's job cost a fresh dataset (budget 10, δ = 1e-5):
    the job counts as its reserved curve or as one (ε, δ) pair at half the δ that pairs may
    hold (its own RDP statement, or its PLD statement), whichever takes less of the room the
    conversion leaves (the curve's RDP at the dataset's order, the pair's ε; both fit here); a
    pair is charged whole with the first attempt, a curve by what ran."""
    trial = rdp_curve(plan["sample_rate"], plan["noise_multiplier"], plan["steps"])
    if validation_noise is not None:
        trial = trial + gaussian_rdp(validation_noise)
    reserved = plan["attempts_reserved"] * trial
    half = PAIR_DELTA_SHARE * 1e-5 / 2
    pair = epsilon_from_rdp(reserved, half)[0]
    if plan["method"]["pld_delta"] is not None:
        mechanism = TrialMechanism(
            sample_rate=plan["sample_rate"],
            noise_multiplier=plan["noise_multiplier"],
            steps=plan["steps"],
            validation_noise=validation_noise,
        )
        by_pld = Rdp(trials=plan["attempts_reserved"], pld_delta=half)
        pair = min(pair, by_pld.pld_epsilon(1e-5, [mechanism]))
    if pair < at_order(reserved):
        return pair
    return through_filter(attempts * trial)


def test_rdp_job_charges_its_plan_and_releases_a_loadable_model(
    service, digits, ray_head, tmp_path
) -> None:
    job = service.post("/v1/jobs", small_job(digits))
    plan = job["plan"]
    assert plan["trials"]["max"] == 2
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]
    assert done["dashboard_url"] == ray_head.dashboard_url

    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    assert sorted(t["params"]["method.threshold"] for t in trials) == [0.5, 2.0]
    assert all(t["status"] == "succeeded" and len(t["attempts"]) == 1 for t in trials)
    assert all(t["thresholds"] is None for t in trials)  # fixed threshold: nothing adaptive
    best = max(trials, key=lambda t: t["score"])
    assert best["released"] and sum(t["released"] for t in trials) == 1
    assert done["progress"] == {"trials_done": 2, "trials_total": 2, "best_score": best["score"]}

    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert len(charged(budget)) == 2
    assert budget["spent"] == pytest.approx(spent_on(plan, 2), rel=1e-9)
    # the dataset counts more than the job's own ε: the first curve pays the conversion
    assert plan["epsilon"] < budget["spent"] < 10.0
    assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
    assert budget["remaining"] == pytest.approx(10.0 - budget["spent"])

    response = service.client.get(f"/v1/jobs/{job['id']}/model", headers=OPERATOR)
    assert response.status_code == 200
    path = tmp_path / "model.safetensors"
    path.write_bytes(response.content)
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    config = json.loads(metadata["config"])
    assert "dataset" not in config and "builtin:digits" not in str(metadata)  # operator-only
    assert json.loads(metadata["dataset"]) == {"num_classes": 10, "input_shape": [1, 8, 8]}
    assert config["method"]["threshold"] == best["params"]["method.threshold"]
    assert config["noise_multiplier"] == plan["noise_multiplier"]
    data = load_dataset(DatasetConfig(source="builtin:digits"))
    model = build_model(
        ModelConfig.model_validate(config["model"]), data.input_shape, data.num_classes
    )
    model.load_state_dict(weights)
    with torch.no_grad():
        accuracy = evaluate(model, data.x_val, data.y_val).accuracy
    assert accuracy == pytest.approx(best["score"], abs=1e-6)  # the released model itself

    info = service.orchestrator.client.get_job_info(service.orchestrator.submission_id(job["id"]))
    assert info.metadata["dptune_job"] == str(job["id"])
    # what the Ray dashboard shows of the job: no operator key, no database URL
    env = info.runtime_env["env_vars"]
    assert set(env) == {
        "DPTUNE_CONTROL_URL",
        "DPTUNE_JOB_TOKEN",
        "DPTUNE_DATA_DIR",
        "DPTUNE_REUSE_PROCESSES",
        "PYTHONUNBUFFERED",
    }
    assert OPERATOR["Authorization"][7:] not in str(info) and "sqlite" not in str(info)


def test_a_search_over_batch_size_runs_each_shape_with_its_own_noise(service, digits) -> None:
    """A grid over batch size: each trial trains with its shape's B and σ (the Tune results
    hold what ran), the ledger charges each trial its own shape's curve, and the released
    model's stored config is its shape's."""
    spec = small_job(digits)
    spec["search_space"] = {"batch_size": {"grid": [32, 128]}}
    job = service.post("/v1/jobs", spec)
    plan = job["plan"]
    assert plan["noise_multiplier"] is None and len(plan["shapes"]) == 2
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]
    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    assert sorted(t["params"]["batch_size"] for t in trials) == [32, 128]
    for trial in trials:
        shape = next(s for s in plan["shapes"] if s["batch_size"] == trial["params"]["batch_size"])
        assert trial["steps"] == shape["steps"]
    budget = service.get(f"/v1/datasets/{digits}/budget")
    shapes = plan["shapes"]
    curves = [rdp_curve(s["sample_rate"], s["noise_multiplier"], s["steps"]) for s in shapes]
    assert plan["epsilon"] == pytest.approx(epsilon_from_rdp(sum(curves), 1e-5)[0], rel=1e-9)
    # its curves through the filter (a pair, its own ε at a share of δ, takes more of the room)
    pair = epsilon_from_rdp(sum(curves), PAIR_DELTA_SHARE * 1e-5 / 2)[0]
    assert at_order(sum(curves)) < pair
    assert budget["spent"] == pytest.approx(through_filter(sum(curves)), rel=1e-9)
    best = next(t for t in trials if t["released"])
    response = service.client.get(f"/v1/jobs/{job['id']}/model", headers=OPERATOR)
    config = json.loads(safe_open_metadata(response.content)["config"])
    shape = next(s for s in plan["shapes"] if s["batch_size"] == best["params"]["batch_size"])
    assert (config["batch_size"], config["noise_multiplier"]) == (
        shape["batch_size"],
        shape["noise_multiplier"],
    )


def test_a_proxy_search_trains_once_on_the_private_data(service, digits) -> None:
    """Every candidate trains on a public proxy; only the best trains on the private dataset,
    charged one trial of its shape."""
    public = service.post(
        "/v1/datasets",
        {"name": "digits-public", "source": "builtin:digits", "epsilon": 1.0, "delta": 1e-5}
        | {"public": True},
    )["id"]
    spec = small_job(digits) | {"proxy": public}
    spec["search_space"] = {
        "method.threshold": {"grid": [0.5, 2.0]},
        "batch_size": {"grid": [32, 128]},
    }
    job = service.post("/v1/jobs", spec)
    done = service.wait(job["id"])
    log = service.orchestrator.logs(job["id"])
    assert done["status"] == "released", log[-5000:]
    assert "proxy search: 4 of 4 candidates finished" in log
    [trial] = service.get(f"/v1/jobs/{job['id']}/trials")
    assert trial["released"] and trial["index"] == 0 and len(trial["attempts"]) == 1
    shape = next(
        s for s in job["plan"]["shapes"] if s["batch_size"] == trial["params"]["batch_size"]
    )
    assert trial["steps"] == shape["steps"]
    curve = rdp_curve(shape["sample_rate"], shape["noise_multiplier"], shape["steps"])
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert epsilon_from_rdp(curve, 1e-5)[0] <= job["plan"]["epsilon"] <= 2.0
    # the shape that ran, through the filter (a pair for the shapes' maximum takes more room)
    shapes = job["plan"]["shapes"]
    top = np.maximum(
        *(rdp_curve(s["sample_rate"], s["noise_multiplier"], s["steps"]) for s in shapes)
    )
    assert at_order(top) < epsilon_from_rdp(top, PAIR_DELTA_SHARE * 1e-5 / 2)[0]
    assert budget["spent"] == pytest.approx(through_filter(curve), rel=1e-9)
    assert service.get(f"/v1/datasets/{public}/budget")["spent"] == 0.0


def test_a_proxy_smaller_than_a_batch_searches_at_its_own_size(service, data_dir) -> None:
    """A proxy of 120 digits searches shapes of batch 512 (more than it holds): each candidate
    trains there at its shape's q and T, and the winner trains once on the 900 private ones."""
    x, y = load_digits(return_X_y=True)
    np.savez(data_dir / "private.npz", x=x[:900].astype(np.float32), y=y[:900])
    np.savez(data_dir / "proxy.npz", x=x[900:1020].astype(np.float32), y=y[900:1020])

    def register(name: str, public: bool) -> int:
        body = {"name": name, "source": f"npz:{name}.npz", "num_classes": 10, "epsilon": 10.0}
        return service.post("/v1/datasets", body | {"delta": 1e-5, "public": public})["id"]

    private, proxy = register("private", False), register("proxy", True)
    spec = small_job(private) | {"proxy": proxy}
    spec["validation"] = {"split": "private", "fraction": 0.2, "noise": 20.0}
    spec["search_space"] = {
        "method.threshold": {"grid": [0.5, 2.0]},
        "batch_size": {"grid": [64, 512]},
    }
    job = service.post("/v1/jobs", spec)
    assert job["plan"]["proxy"]["size"] == 120
    done = service.wait(job["id"])
    log = service.orchestrator.logs(job["id"])
    assert done["status"] == "released", log[-5000:]
    assert "proxy search: 4 of 4 candidates finished" in log
    [trial] = service.get(f"/v1/jobs/{job['id']}/trials")
    shape = next(
        s for s in job["plan"]["shapes"] if s["batch_size"] == trial["params"]["batch_size"]
    )
    assert trial["steps"] == shape["steps"]


def test_a_retried_attempt_is_charged_too(service, digits) -> None:
    """A trial process killed mid-training (kill -9, from outside: no hook in the product)
    is retried, and both of its attempts are charged."""
    spec = small_job(digits, max_retries=1)
    spec["method"]["adaptive"] = {"rule": "dcsgd_p"}  # DC-SGD-P: thresholds are recorded
    spec["epochs"] = 150  # ~6 s of training (an epoch is ~40 ms): the kill lands mid-training
    job = service.post("/v1/jobs", spec)

    victims: list[int] = []

    def training(j: dict) -> bool:
        """Every trial worker holds an open attempt, so the one killed has an attempt to
        fail. Each open attempt runs in a live trial worker, one per worker: when the workers
        are the same before and after the attempts are read, and as many as the open attempts,
        none of them is still importing torch before it records its attempt, or done with it.
        (A worker's title flips between ``.train`` and idle with each epoch's result, so a
        count of ``.train`` workers could match the attempts of others.)"""
        assert j["status"] in ("queued", "running"), "the job ended before a kill could land"
        before = set(trial_processes())
        running = [
            a
            for t in service.get(f"/v1/jobs/{j['id']}/trials")
            for a in t["attempts"]
            if a["ended_at"] is None
        ]
        victims[:] = sorted(before & set(trial_processes()))
        return bool(victims) and len(victims) == len(before) == len(running)

    service.wait(job["id"], until=training)
    victim = victims[0]  # at once: a trial takes seconds
    env = environment(victim)  # a trial holds no database URL and no operator key
    assert env["DPTUNE_JOB_TOKEN"].startswith("dpr_") and "DPTUNE_CONTROL_URL" in env
    assert not {"DPTUNE_DATABASE_URL", "DPTUNE_OPERATOR_KEY"} & set(env)
    assert not any(
        secret in value
        for value in env.values()
        for secret in ("e2e-db-passw0rd", *OPERATOR_ENV.values(), "sqlite")
    )
    os.kill(victim, signal.SIGKILL)
    done = service.wait(job["id"])
    assert done["status"] == "released"
    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    attempts = sorted(len(t["attempts"]) for t in trials)
    assert attempts == [1, 2], (trials, service.orchestrator.logs(job["id"])[-3000:])
    crashed = next(t for t in trials if len(t["attempts"]) == 2)
    assert crashed["attempts"][0]["status"] == "failed"
    assert crashed["epsilon"] == pytest.approx(composed_trials(job["plan"], 2), rel=1e-9)
    for trial in trials:
        assert len(trial["thresholds"]) == job["plan"]["steps"]
    ran = [a for t in trials for a in t["attempts"]]
    assert all(a["status"] != "running" and a["ended_at"] for a in ran)  # none left open
    assert len({a["node"] for a in ran}) == 1 and ran[0]["node"]  # the session's one node
    # the ledger: one charge per attempt that touched data, the dead one included
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert len(charged(budget)) == len(ran) == 3
    assert budget["spent"] == pytest.approx(spent_on(job["plan"], 3), rel=1e-9)
    assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    "privacy",
    [
        {"accounting": "lt", "expected_trials": 2},
        {"accounting": "ps", "mean": 2, "eta": 1},
    ],
)
def test_random_stopping_charges_the_whole_bound_and_shows_analysts_one_trial(
    service, digits, privacy
) -> None:
    analyst = {
        "Authorization": "Bearer "
        + service.post("/v1/keys", {"name": "ana", "role": "analyst", "datasets": [digits]})[
            "secret"
        ]
    }
    accounting = privacy.pop("accounting")
    job = service.post("/v1/jobs", small_job(digits, accounting, **privacy), headers=analyst)
    plan = job["plan"]
    done = service.wait(job["id"])
    assert done["status"] in ("released", "succeeded")
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
    curve = rdp_curve(plan["sample_rate"], plan["noise_multiplier"], plan["steps"])
    if accounting == "ps" and plan["bound"] == "profile":  # an (ε, δ) charge, cap inside
        assert budget["spent"] == pytest.approx(plan["epsilon"], rel=1e-9)
    elif accounting == "ps":  # the bound, whatever K; the cap's TV t = 0.5^cap (geometric, mean
        # 2) costs (1 + e^ε)·t of δ at the dataset's ε, bounded by its budget ε = 10
        tail = 0.5 ** plan["method"]["max_trials"]
        spent = epsilon_from_rdp(tuning_rdp(curve, 2, 1), plan["delta"] - (1 + math.e**10) * tail)
        assert plan["epsilon"] == pytest.approx(spent[0], rel=1e-3)
        # the dataset's filter counts it as its curve or as one pair: at least its own ε
        assert plan["epsilon"] * (1 - 1e-3) <= budget["spent"] < 10.0
    else:
        assert budget["spent"] == pytest.approx(plan["epsilon"], rel=1e-9)
    if accounting == "lt":  # ε = 3ε₁ + 3√(2δ₁), ε₁ from the trial's curve
        delta1 = ((plan["delta"] - plan["method"]["delta2"]) / (3 * plan["trials"]["max"])) ** 2 / 2
        eps1 = epsilon_from_rdp(curve, delta1)[0]
        assert plan["epsilon"] == pytest.approx(3 * eps1 + 3 * (2 * delta1) ** 0.5)

    seen = service.get(f"/v1/jobs/{job['id']}", headers=analyst)
    assert seen["progress"]["trials_total"] == "random"
    assert seen["progress"]["trials_done"] is None
    assert seen["dashboard_url"] is None
    trials = service.get(f"/v1/jobs/{job['id']}/trials", headers=analyst)
    if done["status"] == "released":
        (trial,) = trials
        assert trial["released"] and trial["index"] is None and trial["attempts"] is None
        assert all(m["public"] for m in trial["metrics"])
        assert service.client.get(f"/v1/jobs/{job['id']}/model", headers=analyst).status_code == 200
    else:  # Poisson drew K = 0: nothing ran, nothing to show
        assert trials == []


def test_cancel_charges_what_ran(service, digits) -> None:
    spec = small_job(digits)
    spec["epochs"] = 400  # trials of many seconds: the cancel lands while the job runs
    job = service.post("/v1/jobs", spec)
    service.wait(job["id"], until=lambda j: service.get(f"/v1/jobs/{j['id']}/trials") != [])
    service.post(f"/v1/jobs/{job['id']}/cancel", {})
    done = service.wait(job["id"])
    assert done["status"] == "cancelled"
    attempts = sum(len(t["attempts"]) for t in service.get(f"/v1/jobs/{job['id']}/trials"))
    assert attempts >= 1
    budget = service.get(f"/v1/datasets/{digits}/budget")
    assert len(charged(budget)) == attempts
    assert budget["spent"] == pytest.approx(spent_on(job["plan"], attempts), rel=1e-9)
    assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
    assert service.client.get(f"/v1/jobs/{job['id']}/model", headers=OPERATOR).status_code == 409


def test_restart_reconciles_a_job_stopped_while_the_service_was_down(start_service) -> None:
    with start_service() as first:
        dataset = first.post(
            "/v1/datasets",
            {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
        )["id"]
        job = first.post("/v1/jobs", long_job(dataset))
        first.wait(job["id"], until=lambda j: first.get(f"/v1/jobs/{j['id']}/trials") != [])
        orchestrator = first.orchestrator
    # the service is down; the operator stops the Ray job from the dashboard
    orchestrator.cancel(job["id"])
    deadline = time.monotonic() + 120
    while orchestrator.status(job["id"]) != JobState.CANCELLED:
        assert time.monotonic() < deadline
        time.sleep(1)
    with start_service() as second:
        done = second.get(f"/v1/jobs/{job['id']}")
        assert done["status"] == "cancelled"
        attempts = sum(len(t["attempts"]) for t in second.get(f"/v1/jobs/{job['id']}/trials"))
        budget = second.get(f"/v1/datasets/{dataset}/budget")
        assert len(charged(budget)) == attempts >= 1
        assert budget["spent"] == pytest.approx(spent_on(job["plan"], attempts), rel=1e-9)
        assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)


def test_a_job_lost_by_ray_is_failed_and_charged_in_full(start_service, data_dir) -> None:
    from fastapi.testclient import TestClient

    from service.settings import Settings

    settings = Settings(data_dir=data_dir, operator_key=OPERATOR["Authorization"][7:])
    with TestClient(create_app(settings)) as client:  # never submitted to Ray
        dataset = client.post(
            "/v1/datasets",
            headers=OPERATOR,
            json={"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
        ).json()
        spec = small_job(dataset["id"])
        spec["validation"] = {"split": "private", "noise": 10.0}
        job = client.post("/v1/jobs", headers=OPERATOR, json=spec).json()
    with start_service() as service:
        done = service.get(f"/v1/jobs/{job['id']}")
        assert done["status"] == "failed"
        assert "no record" in done["error"]
        budget = service.get(f"/v1/datasets/{dataset['id']}/budget")
        plan = job["plan"]
        expected = spent_on(plan, 2, validation_noise=10.0)  # the whole reservation
        assert budget["spent"] == pytest.approx(expected, rel=1e-9)
        assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
