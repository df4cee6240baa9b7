"""A job on a Ray cluster of two nodes (separate ``ray start`` processes, token auth on, one
shared data dir): its trials spread over both nodes, and when one node dies mid-job the job
still ends in a defined state with every attempt that touched data charged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import LocalCluster, local_cluster
from .conftest import Service, serving, small_job
from .test_jobs import spent_on


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A head and a worker node of 1 CPU each."""
    with local_cluster() as cluster:
        cluster.start_head(num_cpus=1)
        cluster.add_worker(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster


@pytest.fixture
def service_on(cluster: LocalCluster, tmp_path: Path) -> Iterator[Service]:
    """The service on a real port, its jobs on ``cluster``."""
    with serving(cluster.connection, tmp_path / "data") as service:
        yield service


def test_trials_spread_over_nodes_and_a_dead_node_is_charged(
    cluster: LocalCluster, service_on: Service
) -> None:
    service = service_on
    head, worker = cluster.nodes
    digits = service.post(
        "/v1/datasets",
        {"name": "digits", "source": "builtin:digits", "epsilon": 10.0, "delta": 1e-5},
    )["id"]
    spec = small_job(digits, max_retries=1)
    spec["search_space"] = {"method.threshold": {"grid": [0.5, 1.0, 2.0]}}
    spec["epochs"] = 100  # ~4 s per trial (an epoch is ~40 ms): long enough to die mid-training
    job = service.post("/v1/jobs", spec)

    def attempts() -> list[dict]:
        trials = service.get(f"/v1/jobs/{job['id']}/trials")
        return [a for t in trials for a in t["attempts"]]

    def training_on_worker(_: dict) -> bool:
        return any(a["node"] == worker.id and a["ended_at"] is None for a in attempts())

    service.wait(job["id"], until=training_on_worker, timeout=120)
    worker.kill()  # kill -9 of the node's raylet, agents and workers: the machine died
    done = service.wait(job["id"], timeout=150)

    assert done["status"] in ("released", "failed"), service.orchestrator.logs(job["id"])[-3000:]
    ran = attempts()
    assert {a["node"] for a in ran} == {head.id, worker.id}  # the trials used both nodes
    assert all(a["status"] in ("succeeded", "failed") and a["ended_at"] for a in ran)
    died = [a for a in ran if a["node"] == worker.id and a["status"] == "failed"]
    assert died, ran  # the attempt on the dead node ended as failed — and stays charged
    trials = service.get(f"/v1/jobs/{job['id']}/trials")
    assert all(t["status"] != "running" for t in trials)
    budget = service.get(f"/v1/datasets/{digits}/budget")
    charges = [e for e in budget["entries"] if e["kind"] == "charge"]
    assert len(charges) == len(ran)  # one charge per attempt that touched data
    assert budget["spent"] == pytest.approx(spent_on(job["plan"], len(ran)), rel=1e-9)
    assert budget["reserved"] == pytest.approx(0.0, abs=1e-9)
