"""Secrets stay in the control plane (issue 17, item 13; docs/design.md, invariant 10).

The attack: a Ray job's runtime environment is shown in the Ray dashboard; it carried every
``DPTUNE_*`` variable of the service — the operator key included — and the database URL with
its password. A locally started Ray head inherited them as well, and so did every trial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from runner.settings import RunnerSettings
from service.cluster import RayConnection, RayOrchestrator, ray_jobs
from service.cluster import head as head_module
from service.cluster.ray_jobs import namespace
from service.orchestration import Submission

OPERATOR_KEY = "dpt_operator-super-secret-0123456789"
DATABASE_URL = "postgresql+psycopg://dptune:s3cret-passw0rd@db.internal/dptune"


class RecordingClient:
    """Stands in for Ray's JobSubmissionClient: records what would be submitted."""

    submitted: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def submit_job(self, **kwargs: Any) -> str:
        RecordingClient.submitted.append(kwargs)
        return kwargs["submission_id"]


@pytest.fixture
def service_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPTUNE_OPERATOR_KEY", OPERATOR_KEY)
    monkeypatch.setenv("DPTUNE_DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("DPTUNE_SOME_FUTURE_SETTING", "not for Ray")


def test_a_ray_job_gets_only_the_allow_list(service_env, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ray_jobs, "JobSubmissionClient", RecordingClient)
    RecordingClient.submitted.clear()
    orchestrator = RayOrchestrator(
        RayConnection("http://127.0.0.1:1", "tok", False),
        "http://dptune-api:8000",
        tmp_path,
        namespace(DATABASE_URL),
    )
    orchestrator.submit(Submission(7, "dpr_job-token", "digits"))
    (call,) = RecordingClient.submitted
    env = call["runtime_env"]["env_vars"]
    assert env == {
        "DPTUNE_CONTROL_URL": "http://dptune-api:8000",
        "DPTUNE_JOB_TOKEN": "dpr_job-token",
        "DPTUNE_DATA_DIR": str(tmp_path),
        "DPTUNE_REUSE_PROCESSES": "1",
        "PYTHONUNBUFFERED": "1",
    }
    shown = repr(call)
    assert OPERATOR_KEY not in shown and "s3cret-passw0rd" not in shown
    assert "db.internal" not in shown  # not even the database's host

    # the runner starts from that environment alone
    for name in ("DPTUNE_OPERATOR_KEY", "DPTUNE_DATABASE_URL", "DPTUNE_SOME_FUTURE_SETTING"):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runner = RunnerSettings()  # type: ignore[call-arg]
    assert runner.job_token.get_secret_value() == "dpr_job-token"
    assert runner.control_url == "http://dptune-api:8000"
    assert runner.reuse_processes


def test_a_local_ray_head_does_not_inherit_the_services_settings(
    service_env, monkeypatch, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def fake_run(cmd: list[str], **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise SystemExit  # stop before waiting for a head that never starts

    monkeypatch.setattr(head_module.subprocess, "run", fake_run)
    with pytest.raises(SystemExit):
        head_module._start_head(8299, 1, 0)
    assert not any(name.startswith("DPTUNE_") for name in seen["env"])
    assert OPERATOR_KEY not in repr(seen["env"]) and "s3cret" not in repr(seen["env"])
