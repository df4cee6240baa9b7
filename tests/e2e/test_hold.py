"""A random-stopping job that holds its release keeps its cluster resources until the hold
ends, so another job's start does not tell its K (issue 39, finding 5; docs/design.md,
invariant 11): on the head's two CPUs, a held job's trials take both, and a job submitted
while it holds them gets its first trial started only once the hold has ended.

The other job is submitted once the held job's trial 0 has ended, not while the held job is
still queued: two jobs queued together race for the CPUs, and one whose trials Ray places
first runs before the held job's first trial, so before its hold ends. The design promises
nothing of such a job (its start comes before the held job has run a trial, and so does not
depend on K); it promises that a job which needs the CPUs while the held job has them waits
for the hold's end."""

from __future__ import annotations

from datetime import UTC, datetime

from .conftest import small_job
from .test_reuse import tune_results

ACTIVE = ("queued", "running")


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_a_held_job_keeps_its_cpus_until_its_hold_ends(service, digits, data_dir) -> None:
    spec = small_job(digits, "ps", mean=2, eta=1, hold_release=True)
    spec["resources"] = {"cpu": 2}  # the whole head
    # trials of a tenth of a second make a hold (the cap, about 40, times trial 0) shorter than
    # K trials' gaps: the job could end before a poll saw it running
    spec["epochs"] = 10
    held = service.post("/v1/jobs", spec)
    job = service.wait(
        held["id"], lambda j: j["progress"]["trials_done"] or j["status"] not in ACTIVE
    )
    logs = service.orchestrator.logs
    assert job["status"] == "running", logs(held["id"])[-5000:]
    other = service.post("/v1/jobs", small_job(digits))  # an rdp job: one CPU a trial

    first = service.get(f"/v1/jobs/{held['id']}/trials")[0]["attempts"][0]
    trial_zero = _at(first["ended_at"]) - _at(first["started_at"])
    until = _at(job["started_at"]) + job["plan"]["trials"]["max"] * trial_zero
    # the hold is the cap's worth of trial 0s: minutes on a loaded machine
    done = service.wait(held["id"], timeout=(until - datetime.now(UTC)).total_seconds() + 240)
    assert done["status"] == "released", logs(held["id"])[-5000:]
    assert _at(done["finished_at"]) >= until
    # one trial at a time, in one process: the job never took more, nor freed them before
    assert len({r["pid"] for r in tune_results(data_dir, held["id"])}) == 1

    assert service.wait(other["id"])["status"] == "released"
    trials = service.get(f"/v1/jobs/{other['id']}/trials")
    assert min(_at(t["attempts"][0]["started_at"]) for t in trials) >= until, logs(held["id"])
