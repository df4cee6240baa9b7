"""Analysts reach only their datasets and jobs, and never operator-only endpoints or fields."""

from __future__ import annotations


def test_analyst_scope(api, spec):
    mine, theirs = api.register("mine")["id"], api.register("theirs")["id"]
    ana, other = api.analyst(mine), api.analyst(theirs)
    c = api.client

    assert [d["id"] for d in c.get("/v1/datasets", headers=ana).json()] == [mine]
    for path in (f"/v1/datasets/{theirs}", f"/v1/datasets/{theirs}/budget"):
        assert c.get(path, headers=ana).status_code == 404
    for endpoint in ("/v1/plans", "/v1/jobs"):
        assert c.post(endpoint, headers=ana, json=spec(theirs)).status_code == 404
    assert api.budget(theirs)["entries"] == []

    job = c.post("/v1/jobs", headers=ana, json=spec(mine)).json()["id"]
    for method, path in (
        ("GET", f"/v1/jobs/{job}"),
        ("GET", f"/v1/jobs/{job}/trials"),
        ("GET", f"/v1/jobs/{job}/model"),
        ("POST", f"/v1/jobs/{job}/cancel"),
    ):
        assert c.request(method, path, headers=other).status_code == 404
    assert c.get("/v1/jobs", headers=other).json() == []
    assert c.get(f"/v1/jobs/{job}", headers=api.operator).status_code == 200

    # A colleague on the same dataset sees the budget, not whose job reserved it.
    colleague = api.analyst(mine)
    assert c.get(f"/v1/jobs/{job}", headers=colleague).status_code == 404
    [entry] = c.get(f"/v1/datasets/{mine}/budget", headers=colleague).json()["entries"]
    assert entry["job"] is None and entry["reference"] is None and entry["epsilon"] > 0
    [entry] = c.get(f"/v1/datasets/{mine}/budget", headers=ana).json()["entries"]
    assert entry["job"] == job


def test_operator_only(api, dataset, ana):
    c = api.client
    assert c.get("/v1/keys", headers=ana).status_code == 403
    r = c.post("/v1/keys", headers=ana, json={"role": "operator"})
    assert r.status_code == 403
    r = c.post(
        "/v1/datasets",
        headers=ana,
        json={"name": "x", "source": "builtin:digits", "epsilon": 1, "delta": 1e-5},
    )
    assert r.status_code == 403
    assert len(c.get("/v1/keys", headers=api.operator).json()) == 2  # nothing was created

    seen = c.get(f"/v1/datasets/{dataset['id']}", headers=ana).json()
    assert seen["source"] is None and seen["options"] is None
    assert c.get(f"/v1/datasets/{dataset['id']}", headers=api.operator).json()["source"]


def test_key_validation(api, dataset):
    c = api.client
    r = c.post("/v1/keys", headers=api.operator, json={"role": "analyst", "datasets": [99]})
    assert r.status_code == 422 and r.json()["detail"].startswith("datasets:")
    r = c.post(
        "/v1/keys", headers=api.operator, json={"role": "operator", "datasets": [dataset["id"]]}
    )
    assert r.status_code == 422 and r.json()["detail"].startswith("datasets:")
    r = c.post("/v1/keys", headers=api.operator, json={"role": "root"})
    assert r.status_code == 422 and r.json()["detail"].startswith("role:")
