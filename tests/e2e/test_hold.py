"""A random-stopping job that holds its release keeps its cluster resources until the hold
ends, so another job's start does not tell its K (issue 39, finding 5; docs/design.md,
invariant 11): on the head's two CPUs, a held job's trials take both, and a job submitted
next to it gets its first trial started only once the hold has ended."""

from __future__ import annotations

from datetime import datetime

from .conftest import small_job
from .test_reuse import tune_results


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_a_held_job_keeps_its_cpus_until_its_hold_ends(service, digits, data_dir) -> None:
    spec = small_job(digits, "ps", mean=2, eta=1, hold_release=True)
    spec["resources"] = {"cpu": 2}  # the whole head
    held = service.post("/v1/jobs", spec)
    service.wait(held["id"], lambda j: j["progress"]["trials_done"] or j["status"] != "running")
    other = service.post("/v1/jobs", small_job(digits))  # an rdp job: one CPU a trial

    done = service.wait(held["id"])
    assert done["status"] == "released", service.orchestrator.logs(held["id"])[-5000:]
    first = service.get(f"/v1/jobs/{held['id']}/trials")[0]["attempts"][0]
    trial_zero = _at(first["ended_at"]) - _at(first["started_at"])
    until = _at(done["started_at"]) + done["plan"]["trials"]["max"] * trial_zero
    assert _at(done["finished_at"]) >= until
    # one trial at a time, in one process: the job never took more, nor freed them before
    assert len({r["pid"] for r in tune_results(data_dir, held["id"])}) == 1

    assert service.wait(other["id"])["status"] == "released"
    trials = service.get(f"/v1/jobs/{other['id']}/trials")
    assert min(_at(t["attempts"][0]["started_at"]) for t in trials) >= until
