"""List endpoints: an unknown query parameter is a 422 naming it, never ignored; filters
agree with what the caller sees unfiltered; ``X-Total-Count`` counts every match. An analyst's
status filter on a random-stopping job filters on the status the analyst sees (invariant 11)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.db import Job

from .conftest import make_spec

LISTS = ("/v1/jobs", "/v1/datasets", "/v1/keys", "/v1/datasets/{dataset}/ledger")
UNKNOWN = ("stauts", "Status", "limit_", "dataset_id", "q", "afters")
STATUSES = ("queued", "running", "succeeded", "released", "failed", "cancelled")


@pytest.mark.parametrize("path", LISTS)
def test_every_list_refuses_an_unknown_parameter_by_name(api, dataset, path):
    path = path.format(dataset=dataset["id"])
    r = api.client.get(path, headers=api.operator)
    assert r.status_code == 200 and r.headers["X-Total-Count"].isdigit()
    for name in UNKNOWN:
        r = api.client.get(path, headers=api.operator, params={name: "running"})
        assert r.status_code == 422, (name, r.text)
        assert r.json()["errors"][0]["field"] == name


def test_every_list_declares_its_count(client):
    paths = client.app.openapi()["paths"]
    for path in LISTS:
        ok = paths[path.replace("{dataset}", "{dataset_id}")]["get"]["responses"]["200"]
        assert "X-Total-Count" in ok["headers"]


def _lt(dataset: int, **privacy) -> dict:
    body = make_spec(
        dataset, epsilon=1.8, accounting="lt", expected_trials=3, delta=5e-8, **privacy
    )
    body["search_space"] = {"optimizer.lr": {"values": [0.05, 0.1, 0.2]}}
    return body


def _set(client, job: int, status: str, started: bool) -> None:
    with client.app.state.sessions() as session:
        row = session.get(Job, job)
        row.status = status
        row.started_at = datetime.now(UTC) if started else None
        session.commit()


def _listed(api, headers, **query) -> tuple[list[int], int]:
    r = api.client.get("/v1/jobs", headers=headers, params=query)
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()], int(r.headers["X-Total-Count"])


def test_job_filters_agree_with_the_views(api):
    """Every status filter, for an operator and for the analyst, lists exactly the jobs whose
    status the caller sees as that, newest first, counted in full: an lt job whose release is
    held looks ``running`` to the analyst whatever it is, one that ended without a model
    ``failed``, and the filter says no more."""
    c = api.client
    first, second = api.register("a", epsilon=100)["id"], api.register("b", epsilon=100)["id"]
    ana = api.analyst(first, second)
    states = [  # (spec, stored status, started)
        (make_spec(first, 0.5), "queued", False),
        (make_spec(first, 0.5), "running", True),
        (make_spec(second, 0.5), "failed", True),
        (_lt(first), "succeeded", True),  # no model: "failed" to the analyst
        (_lt(first, hold_release=True), "failed", True),  # held: "running"
        (_lt(second, hold_release=True), "released", True),  # held: "running"
        (_lt(second), "cancelled", False),
    ]
    for body, status, started in states:
        r = c.post("/v1/jobs", headers=ana, json=body)
        assert r.status_code == 202, r.text
        _set(c, r.json()["id"], status, started)
    c.post("/v1/jobs", headers=api.operator, json=make_spec(first, 0.5))  # not the analyst's

    for headers in (api.operator, ana):
        every = c.get("/v1/jobs", headers=headers).json()
        assert _listed(api, headers) == ([j["id"] for j in every], len(every))
        for status in STATUSES:
            for dataset in (None, first, second):
                want = [
                    j["id"]
                    for j in every
                    if j["status"] == status and dataset in (None, j["dataset"])
                ]
                query = {"status": status} | ({"dataset": dataset} if dataset else {})
                assert _listed(api, headers, **query) == (want, len(want)), query
                got = _listed(api, headers, **query, limit=1, offset=1)
                assert got == (want[1:2], len(want))
    seen = {j["id"]: j["status"] for j in c.get("/v1/jobs", headers=ana).json()}
    assert sorted(seen.values()) == sorted(
        ["queued", "running", "failed", "failed", "running", "running", "cancelled"]
    )
    r = c.get("/v1/jobs", headers=ana, params={"status": "lost"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "status"


def test_pages_and_filters_of_datasets_and_keys(api):
    c = api.client
    ids = [api.register(f"d{i}")["id"] for i in range(3)]
    ana = api.analyst(ids[0], ids[2])
    r = c.get("/v1/datasets", headers=api.operator, params={"limit": 2, "offset": 1})
    assert [d["id"] for d in r.json()] == ids[1:] and r.headers["X-Total-Count"] == "3"
    r = c.get("/v1/datasets", headers=ana, params={"limit": 1})
    assert [d["id"] for d in r.json()] == ids[:1] and r.headers["X-Total-Count"] == "2"

    r = c.get("/v1/keys", headers=api.operator, params={"dataset": ids[2]})
    assert len(r.json()) == 1 and r.headers["X-Total-Count"] == "1"
    assert r.json()[0]["datasets"] == [ids[0], ids[2]]
    r = c.get("/v1/keys", headers=api.operator, params={"role": "operator"})
    assert [k["bootstrap"] for k in r.json()] == [True]
    r = c.get("/v1/keys", headers=api.operator, params={"status": "expired"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "status"


def test_the_ledger_counts_the_rows_the_caller_sees(api, dataset):
    c = api.client
    for _ in range(3):
        c.post("/v1/jobs", headers=api.operator, json=make_spec(dataset["id"], 0.5))
    r = c.get(f"/v1/datasets/{dataset['id']}/ledger", headers=api.operator, params={"limit": 1})
    assert len(r.json()["entries"]) == 1 and r.headers["X-Total-Count"] == "3"
