"""What an operator reads of a job in the Ray dashboard: its name in the Jobs list, and its
log — Tune's progress table with each trial's hyperparameters, DP score and ε, then the
closing table of trials, the job's charge and the released trial, as the control plane
recorded them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .conftest import small_job
from .test_jobs import composed_trials


def _cells(line: str, bar: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip(bar).split(bar)]


def tune_table(logs: str) -> list[dict[str, str]]:
    """The rows of Tune's last progress table (``| Trial name | status | … |``)."""
    lines = logs.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| Trial name"))
    header = _cells(lines[start], "|")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append(dict(zip(header, _cells(line, "|"), strict=True)))
    return rows


def closing_table(logs: str, job_id: int) -> list[dict[str, str]]:
    """The rows of the table the driver ends its log with."""
    lines = [line.rstrip() for line in logs.splitlines()]
    start = lines.index(f"dptune job {job_id}: trials") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    body = [line for line in lines[start:end] if line.startswith("│")]
    header, *rows = (_cells(line, "│") for line in body)
    return [dict(zip(header, row, strict=True)) for row in rows]


def shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def check_logs(service, job: dict[str, Any]) -> tuple[str, dict[int, dict]]:
    """The job's log against what the control plane recorded (the operator's trial view);
    the log (as a terminal shows it) and that record, by trial index."""
    logs = service.finished_logs(job["id"])
    # the dashboard's log viewer collapses runs of spaces: tables pad with no-break spaces
    tables = [line for line in logs.splitlines() if line.startswith(("+", "|", "╭", "│", "╰"))]
    assert tables and not any(" " in line for line in tables)
    logs = logs.replace("\u00a0", " ")
    recorded = {t["index"]: t for t in service.get(f"/v1/jobs/{job['id']}/trials")}
    assert recorded, logs[-5000:]

    progress = {int(row["trial"]): row for row in tune_table(logs)}
    assert set(progress) == set(recorded), logs[-5000:]
    for index, trial in recorded.items():
        row = progress[index]
        assert row["status"] == "TERMINATED"
        assert float(row["method.threshold"]) == trial["params"]["method.threshold"]
        assert int(row["steps"]) == trial["steps"] == job["plan"]["steps"]
        assert float(row["DP score"]) == pytest.approx(trial["score"], rel=1e-4)
        assert float(row["ε"]) == pytest.approx(job["plan"]["trial_epsilon"], rel=1e-4)

    closing = closing_table(logs, job["id"])
    assert [int(row["trial"]) for row in closing] == sorted(recorded), logs[-5000:]
    for row in closing:
        trial = recorded[int(row["trial"])]
        assert row == {
            "trial": str(trial["index"]),
            "method.threshold": shown(trial["params"]["method.threshold"]),
            "status": "finished",
            "steps": str(trial["steps"]),
            "DP score": shown(trial["score"]),
            "ε": shown(trial["epsilon"]),
            "attempts": str(len(trial["attempts"])),
        }
    return logs, recorded


def check_summary(service, job: dict[str, Any], logs: str, recorded: dict[int, dict]) -> None:
    charged = re.search(r"^charged: ε = (\S+) at δ = (\S+) \((\w+)\)$", logs, re.MULTILINE)
    assert charged, logs[-3000:]
    budget = service.get(f"/v1/datasets/{job['spec']['dataset']}/budget")
    # the job's own ε (fixed K: of the attempts that ran; random stopping: the whole bound);
    # the dataset, the job's only one, counts at least that through its filter
    own = job["plan"]["epsilon"]
    if job["plan"]["accounting"] == "rdp":
        own = composed_trials(job["plan"], sum(len(t["attempts"]) for t in recorded.values()))
    assert float(charged[1]) == pytest.approx(own, rel=1e-3)
    assert float(charged[1]) <= budget["spent"] * (1 + 1e-3)
    assert float(charged[2]) == pytest.approx(job["plan"]["delta"], rel=1e-6)
    assert charged[3] == job["plan"]["accounting"]
    (best,) = (t for t in recorded.values() if t["released"])
    threshold = shown(best["params"]["method.threshold"])
    assert (
        f"released: trial {best['index']} (method.threshold = {threshold}), "
        f"DP score {shown(best['score'])}"
    ) in logs


def job_name(service, job_id: int) -> str:
    info = service.orchestrator.client.get_job_info(service.orchestrator.submission_id(job_id))
    return info.metadata["job_name"]


def test_an_operator_reads_a_fixed_k_jobs_trials_in_its_log(service, digits) -> None:
    job = service.post("/v1/jobs", small_job(digits))
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]
    logs, recorded = check_logs(service, job)
    assert sorted(t["params"]["method.threshold"] for t in recorded.values()) == [0.5, 2.0]
    check_summary(service, job, logs, recorded)
    assert (
        job_name(service, job["id"])
        == f"dptune job {job['id']} · logreg on digits · rdp · 2 trials"
    )


def test_a_random_stopping_trial_reports_the_candidate_it_drew(service, digits) -> None:
    """Its config holds only its index; the hyperparameters in the log are those it drew and
    recorded. K = 1 here (Liu–Talwar stopping after each trial with probability 1), but the
    job's name never counts trials."""
    job = service.post("/v1/jobs", small_job(digits, "lt", gamma=1.0))
    done = service.wait(job["id"])
    assert done["status"] == "released", service.orchestrator.logs(job["id"])[-5000:]
    logs, recorded = check_logs(service, job)
    assert recorded[0]["params"]["method.threshold"] in (0.5, 1.0, 2.0)
    check_summary(service, job, logs, recorded)
    assert job_name(service, job["id"]) == f"dptune job {job['id']} · logreg on digits · lt"
