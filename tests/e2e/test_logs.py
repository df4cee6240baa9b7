"""On a real Ray cluster of one 2-CPU node (issue 42): a job whose trials ask more CPUs than any
node has is refused at admission with nothing reserved, and a job's driver log is read
through the API by an operator, never by an analyst.

The cluster is :func:`tests.e2e.cluster.local_cluster`, stopped by its own processes' ids."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import LocalCluster, local_cluster
from .conftest import Service, serving, small_job


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with local_cluster() as cluster:
        cluster.start_head(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster


@pytest.fixture
def service_on(cluster: LocalCluster, tmp_path: Path) -> Iterator[Service]:
    with serving(cluster.connection, tmp_path / "data") as service:
        yield service


def test_unschedulable_job_is_refused_and_logs_are_for_operators(service_on: Service) -> None:
    service = service_on
    dataset = service.post(
        "/v1/datasets",
        {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
    )["id"]
    key = service.post("/v1/keys", {"name": "ana", "role": "analyst", "datasets": [dataset]})[
        "secret"
    ]
    analyst = {"Authorization": f"Bearer {key}"}
    budget = service.get(f"/v1/datasets/{dataset}/budget")

    too_big = small_job(dataset) | {"resources": {"cpu": 64}}
    r = service.client.post("/v1/jobs", headers=analyst, json=too_big)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "resources.cpu"
    assert "the most any node has is 2" in r.json()["detail"]
    assert service.get(f"/v1/datasets/{dataset}/budget") == budget  # nothing reserved
    assert service.get("/v1/jobs") == []

    job = service.post("/v1/jobs", small_job(dataset) | {"resources": {"cpu": 2}}, analyst)
    logs = f"/v1/jobs/{job['id']}/logs"
    deadline = time.monotonic() + 120
    while not (page := service.get(logs))["lines"]:
        assert time.monotonic() < deadline, "the job's driver printed nothing"
        time.sleep(1)
    assert page["offset"] == 0 and page["total"] >= len(page["lines"]) > 0
    assert service.client.get(logs, headers=analyst).status_code == 403
    service.wait(job["id"])
    service.finished_logs(job["id"])  # the driver prints its closing table after the job ended
    full = service.get(f"{logs}?limit=10000")
    assert f"dptune job {job['id']}: trials" in "\n".join(full["lines"])  # its closing table
    assert full["total"] == len(full["lines"]) and full["next_offset"] == full["total"]
    assert service.orchestrator.message(job["id"])  # what Ray says of the job, for operators
