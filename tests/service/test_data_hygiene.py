"""What reaches a trial is what the operator registered (issue 17, items 3, 10, 11, 12).

Attacks stopped here: a planted NaN/inf record (whether the model comes out NaN tells whether
it was sampled), a label set read off private labels and published, a file swapped after
registration (q = B/N and T were planned from the registered N), a selection metric computed
on private data without noise.
"""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy.orm import Session

from core.config import DatasetConfig, TrialConfig
from service.db import Dataset, create_db_engine
from workers.trial import run_trial


def _npz(path, n=40, **overrides) -> None:
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(n, 4)).astype(np.float32), "y": rng.integers(0, 3, size=n)}
    np.savez(path, **{**arrays, **overrides})


def _post(api, name, source, **extra):
    return api.client.post(
        "/v1/datasets",
        headers=api.operator,
        json={"name": name, "source": source, "epsilon": 4.0, "delta": 1e-5, **extra},
    )


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e39])  # 1e39 is inf in float32
def test_non_finite_features_are_refused_naming_the_row(api, settings, value) -> None:
    x = np.random.default_rng(1).normal(size=(40, 4))
    x[17, 2] = value
    _npz(settings.data_path / "bad.npz", x=x)
    r = _post(api, "bad", "npz:bad.npz", num_classes=3)
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    assert error["field"] == "source" and "x[17]" in error["message"]
    assert api.client.get("/v1/datasets", headers=api.operator).json() == []  # nothing stored


def test_non_finite_public_validation_is_refused_too(api, settings) -> None:
    x_val = np.zeros((5, 4))
    x_val[3, 0] = np.nan
    _npz(settings.data_path / "bad.npz", x_val=x_val, y_val=np.zeros(5, dtype=int))
    r = _post(api, "bad", "npz:bad.npz", num_classes=3)
    assert r.status_code == 422 and "x_val[3]" in r.json()["detail"]


def test_label_set_is_declared_not_read_off_private_labels(api, settings) -> None:
    _npz(settings.data_path / "mine.npz")  # labels 0..2
    r = _post(api, "mine", "npz:mine.npz")
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "num_classes"
    dataset = _post(api, "mine", "npz:mine.npz", num_classes=7)
    assert dataset.status_code == 201 and dataset.json()["num_classes"] == 7  # not max + 1

    y = np.zeros(40, dtype=int)
    y[5] = 3
    _npz(settings.data_path / "outside.npz", y=y)
    r = _post(api, "outside", "npz:outside.npz", num_classes=3)
    assert r.status_code == 422 and "y[5] = 3" in r.json()["detail"]
    r = _post(api, "digits", "builtin:digits", num_classes=12)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "num_classes"
    assert _post(api, "digits", "builtin:digits", num_classes=10).status_code == 201


def test_a_trial_refuses_data_changed_after_registration(api, settings) -> None:
    path = settings.data_path / "mine.npz"
    _npz(path)
    registered = _post(api, "mine", "npz:mine.npz", num_classes=3).json()
    with Session(create_db_engine(settings.sqlalchemy_url)) as session:
        row = session.get(Dataset, registered["id"])
        data = DatasetConfig(
            source=row.source, num_classes=row.num_classes, sha256=row.content_sha256
        )
    cfg = TrialConfig(
        dataset=data,
        model={"name": "logreg"},
        batch_size=8,
        epochs=0.2,
        noise_multiplier=1.0,
        validation={"split": "private", "noise": 1.0},
        device="cpu",
    )
    assert run_trial(cfg, data_dir=settings.data_path).result["steps"] >= 1
    _npz(path, n=80)  # the file grows: q = B/N would be overstated, the cost understated
    with pytest.raises(ValueError, match=r"dataset\.sha256"):
        run_trial(cfg, data_dir=settings.data_path)


def test_operators_see_source_analysts_do_not(api) -> None:
    dataset = api.register()
    ana = api.analyst(dataset["id"])
    seen = api.client.get(f"/v1/datasets/{dataset['id']}", headers=ana).json()
    assert seen["source"] is None and "content_sha256" not in seen


@pytest.mark.parametrize("metric", ["train_loss", "val_loss", "accuracy"])
def test_selection_metrics_other_than_the_dp_score_are_refused(
    client, dataset, ana, spec, metric
) -> None:
    body = spec(dataset["id"]) | {"selection": {"metric": metric, "mode": "max"}}
    for path in ("/v1/plans", "/v1/jobs"):
        r = client.post(path, headers=ana, json=body)
        assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith(
            "selection.metric"
        ), r.text
    assert client.get("/v1/jobs", headers=ana).json() == []


def test_seed_is_refused_for_random_stopping_jobs(client, dataset, ana, spec) -> None:
    body = spec(dataset["id"], accounting="ps", mean=2, eta=1)
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.2]}}
    assert client.post("/v1/plans", headers=ana, json=body).status_code == 200
    r = client.post("/v1/plans", headers=ana, json=body | {"seed": 7})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "seed", r.text
    rdp = spec(dataset["id"]) | {"seed": 7}
    assert client.post("/v1/plans", headers=ana, json=rdp).status_code == 200
