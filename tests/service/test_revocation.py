"""Revocation and clean-up: a revoked key gets 401 at once on every route, and its jobs and
ledger rows stay; a new ``DPTUNE_OPERATOR_KEY`` shuts the old one out; a dataset is deleted
only while nothing was ever charged to it or made on it (the ledger is append-only)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from service.api import create_app
from service.settings import Settings, StartupError

from .conftest import OPERATOR_KEY, Api, bearer, make_spec


def _key(api: Api, role: str = "analyst", datasets: tuple[int, ...] = ()) -> tuple[int, dict]:
    r = api.client.post(
        "/v1/keys", headers=api.operator, json={"role": role, "datasets": list(datasets)}
    )
    assert r.status_code == 201, r.text
    return r.json()["id"], bearer(r.json()["secret"])


def _keys(api: Api, **query: str) -> dict[int, dict]:
    r = api.client.get("/v1/keys", headers=api.operator, params=query)
    assert r.status_code == 200, r.text
    return {k["id"]: k for k in r.json()}


def _routes(client: TestClient) -> list[tuple[str, str]]:
    """Every public route of the API (its OpenAPI paths under /v1/), as (method, path with
    ids filled in)."""
    paths = client.app.openapi()["paths"]
    return [
        (method.upper(), re.sub(r"\{\w+\}", "1", path))
        for path, methods in paths.items()
        if path.startswith("/v1/")
        for method in methods
    ]


def test_a_revoked_key_gets_401_on_every_route_and_its_records_stay(api, dataset):
    c = api.client
    ana_id, ana = _key(api, datasets=(dataset["id"],))
    other_op_id, other_op = _key(api, "operator")
    job = c.post("/v1/jobs", headers=ana, json=make_spec(dataset["id"])).json()["id"]
    before = api.budget(dataset["id"])
    assert c.get(f"/v1/jobs/{job}", headers=ana).status_code == 200

    for key_id in (ana_id, other_op_id):
        assert c.delete(f"/v1/keys/{key_id}", headers=api.operator).status_code == 204
    routes = _routes(c)
    assert ("DELETE", "/v1/keys/1") in routes and len(routes) > 10
    for headers in (ana, other_op):
        for method, path in routes:
            r = c.request(method, path, headers=headers)
            assert r.status_code == 401, (method, path, r.text)

    assert c.get(f"/v1/jobs/{job}", headers=api.operator).json()["id"] == job
    assert api.budget(dataset["id"]) == before  # the reservation stays on the ledger
    keys = _keys(api)
    assert keys[ana_id]["revoked_at"] is not None and keys[other_op_id]["revoked_at"]
    assert list(_keys(api, status="revoked")) == [ana_id, other_op_id]
    assert ana_id not in _keys(api, status="active")
    # revoking again changes nothing; an unknown key is a 404, an analyst may not revoke
    assert c.delete(f"/v1/keys/{ana_id}", headers=api.operator).status_code == 204
    assert _keys(api)[ana_id]["revoked_at"] == keys[ana_id]["revoked_at"]
    assert c.delete("/v1/keys/999", headers=api.operator).status_code == 404
    _, live = _key(api, datasets=(dataset["id"],))
    assert c.delete(f"/v1/keys/{ana_id}", headers=live).status_code == 403


def test_the_last_operator_key_cannot_be_revoked(api):
    c = api.client
    [bootstrap] = _keys(api, role="operator")
    r = c.delete(f"/v1/keys/{bootstrap}", headers=api.operator)
    assert r.status_code == 409 and r.json()["detail"].startswith("key:")
    second, headers = _key(api, "operator")
    assert c.delete(f"/v1/keys/{bootstrap}", headers=headers).status_code == 204
    assert c.get("/v1/keys", headers=api.operator).status_code == 401
    assert c.delete(f"/v1/keys/{second}", headers=headers).status_code == 409
    assert c.get("/v1/keys", headers=headers).status_code == 200


def _revoke(api: Api, barrier: threading.Barrier, codes: list, key: int, headers: dict) -> None:
    barrier.wait()
    codes.append(api.client.delete(f"/v1/keys/{key}", headers=headers).status_code)


def test_operators_revoking_each_other_at_once_leave_one(api):
    """Two operators, each revoking the other's key at the same instant: one wins."""
    for _ in range(3):
        (a, a_headers), (b, b_headers) = _key(api, "operator"), _key(api, "operator")
        for key in _keys(api, role="operator", status="active"):
            if key not in (a, b):
                assert api.client.delete(f"/v1/keys/{key}", headers=a_headers).status_code == 204
        barrier, codes = threading.Barrier(2), []
        threads = [
            threading.Thread(target=_revoke, args=(api, barrier, codes, b, a_headers)),
            threading.Thread(target=_revoke, args=(api, barrier, codes, a, b_headers)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) in ([204, 401], [204, 409])
        survivor = a_headers if api.client.get("/v1/keys", headers=a_headers).is_success else None
        api.operator = survivor or b_headers
        assert len(_keys(api, role="operator", status="active")) == 1


def _settings(settings: Settings, key: str | None) -> Settings:
    return settings.model_copy(update={"operator_key": SecretStr(key) if key else None})


def test_a_new_operator_key_replaces_the_old_one(settings):
    old, new = bearer(OPERATOR_KEY), bearer("dpt_the-new-operator-key-9876543210")
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/keys", headers=old).status_code == 200
    with TestClient(create_app(_settings(settings, new["Authorization"][7:]))) as c:
        assert c.get("/v1/keys", headers=old).status_code == 401
        keys = c.get("/v1/keys", headers=new).json()
        assert [(k["bootstrap"], k["revoked_at"] is None) for k in keys] == [
            (True, False),
            (True, True),
        ]
    with TestClient(create_app(_settings(settings, None))) as c:  # unset: the last one stays
        assert c.get("/v1/keys", headers=new).status_code == 200
        assert c.get("/v1/keys", headers=old).status_code == 401
    revoked = pytest.raises(StartupError, match="DPTUNE_OPERATOR_KEY is key 1, which is revoked")
    with revoked, TestClient(create_app(settings)):  # a revoked key never comes back
        pass


def test_a_configured_key_replaces_a_printed_one(tmp_path, capsys, database_url):
    settings = Settings(data_dir=tmp_path, database_url=database_url)
    with TestClient(create_app(settings)):
        pass
    printed = bearer(capsys.readouterr().out.split("(shown once): ")[1].strip())
    with TestClient(create_app(_settings(settings, OPERATOR_KEY))) as c:
        assert c.get("/v1/keys", headers=printed).status_code == 401
        assert c.get("/v1/keys", headers=bearer(OPERATOR_KEY)).status_code == 200


# Datasets


def test_a_dataset_never_charged_is_deleted(api, settings):
    c = api.client
    mistyped = api.register("digtis")["id"]
    _, ana = _key(api, datasets=(mistyped,))
    announced = c.post(
        "/v1/datasets",
        headers=api.operator,
        json={"name": "up", "source": "upload", "format": "npz", "num_classes": 2}
        | {"epsilon": 1, "delta": 1e-5},
    ).json()["id"]
    buffer = settings.data_path / "mine.npz"
    np.savez(buffer, x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    r = c.put(f"/v1/datasets/{announced}/data", headers=api.operator, content=buffer.read_bytes())
    assert r.status_code == 200, r.text
    uploaded = settings.data_path / "uploads" / f"{announced}.npz"
    assert uploaded.exists()
    registered = api.register("file", source="npz:mine.npz", num_classes=2)["id"]

    for dataset in (mistyped, announced, registered):
        assert c.delete(f"/v1/datasets/{dataset}", headers=api.operator).status_code == 204
        assert c.get(f"/v1/datasets/{dataset}", headers=api.operator).status_code == 404
        assert c.delete(f"/v1/datasets/{dataset}", headers=api.operator).status_code == 404
    assert not uploaded.exists()
    assert buffer.exists()  # a registered file is the operator's own
    assert c.get("/v1/datasets", headers=api.operator).json() == []
    assert c.get("/v1/datasets", headers=ana).json() == []
    assert api.register("digtis")["id"] > registered  # the name is free again
    assert c.delete(f"/v1/datasets/{registered}", headers=ana).status_code == 403


def test_a_dataset_with_a_ledger_or_a_job_stays(api, spec):
    c = api.client
    private = api.register("private", epsilon=8.0)["id"]
    public = api.register("public", public=True)["id"]
    body = spec(private, 2.0) | {"proxy": public}
    body["search_space"] = {"optimizer.lr": {"grid": [0.05, 0.2]}}
    job = c.post("/v1/jobs", headers=api.operator, json=body)
    assert job.status_code == 202, job.text
    ledger = c.get(f"/v1/datasets/{private}/ledger", headers=api.operator).json()

    r = c.delete(f"/v1/datasets/{private}", headers=api.operator)
    assert r.status_code == 409 and r.json()["detail"] == (
        f"dataset: dataset {private} cannot be deleted: its ledger has rows, and the ledger is "
        "append-only"
    )
    r = c.delete(f"/v1/datasets/{public}", headers=api.operator)
    assert r.status_code == 409
    assert r.json()["detail"].endswith(f"job {job.json()['id']} uses it")
    assert c.get(f"/v1/datasets/{private}/ledger", headers=api.operator).json() == ledger


def test_a_dataset_deleted_while_a_job_is_planned_gets_404(api, spec, monkeypatch):
    """The job's plan was made on the dataset, then it was deleted before the job's
    reservation took the budget lock: 404, nothing admitted."""
    from service.api import jobs

    c = api.client
    dataset = api.register()["id"]
    planned = jobs.plan_with_model

    def plan_then_delete(*args, **kwargs):
        plan = planned(*args, **kwargs)
        assert c.delete(f"/v1/datasets/{dataset}", headers=api.operator).status_code == 204
        return plan

    monkeypatch.setattr(jobs, "plan_with_model", plan_then_delete)
    r = c.post("/v1/jobs", headers=api.operator, json=spec(dataset))
    assert r.status_code == 404 and r.json()["detail"] == f"dataset: dataset {dataset} not found"
    assert c.get("/v1/jobs", headers=api.operator).json() == []


def test_a_dataset_deleted_during_its_upload_gets_404_and_no_file(api, settings, monkeypatch):
    import workers.data

    c = api.client
    body = {"name": "up", "source": "upload", "format": "npz", "num_classes": 2}
    dataset = c.post(
        "/v1/datasets", headers=api.operator, json=body | {"epsilon": 1, "delta": 1e-5}
    )
    dataset = dataset.json()["id"]
    described = workers.data.describe

    def describe_then_delete(*args, **kwargs):
        info = described(*args, **kwargs)
        assert c.delete(f"/v1/datasets/{dataset}", headers=api.operator).status_code == 204
        return info

    monkeypatch.setattr(workers.data, "describe", describe_then_delete)
    npz = settings.data_path / "mine.npz"
    np.savez(npz, x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    r = c.put(f"/v1/datasets/{dataset}/data", headers=api.operator, content=npz.read_bytes())
    assert r.status_code == 404 and r.json()["detail"] == f"dataset {dataset} not found"
    assert list((settings.data_path / "uploads").iterdir()) == []
