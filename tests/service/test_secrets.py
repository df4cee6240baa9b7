"""Secrets stay in the control plane (issue 17, item 13; DESIGN.md invariant 10).

The attack: a Ray job's runtime environment is shown in the Ray dashboard; it carried every
``DPTUNE_*`` variable of the service — the operator key included — and the database URL with
its password. A locally started Ray head inherited them as well, and so did every trial.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, ClassVar

import pytest

from service.cluster import RayConnection, RayOrchestrator
from service.cluster import head as head_module
from service.cluster import orchestrator as orchestrator_module
from service.orchestrator import Submission
from service.settings import Settings

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
    monkeypatch.setattr(orchestrator_module, "JobSubmissionClient", RecordingClient)
    RecordingClient.submitted.clear()
    orchestrator = RayOrchestrator(RayConnection("http://127.0.0.1:1", "tok", False),
                                   DATABASE_URL, tmp_path)
    orchestrator.submit(Submission(7, {}, {}, "builtin:digits", {}))
    (call,) = RecordingClient.submitted
    env = call["runtime_env"]["env_vars"]
    assert set(env) == {"DPTUNE_DATA_DIR", "DPTUNE_DATABASE_URL_FILE", "PYTHONUNBUFFERED"}
    shown = repr(call)
    assert OPERATOR_KEY not in shown and "s3cret-passw0rd" not in shown

    url_file = Path(env["DPTUNE_DATABASE_URL_FILE"])
    assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
    assert url_file.read_text() == DATABASE_URL
    # the driver reads the URL from the file, with only the allow-list in its environment
    for name in ("DPTUNE_OPERATOR_KEY", "DPTUNE_DATABASE_URL", "DPTUNE_SOME_FUTURE_SETTING"):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    driver = Settings()
    assert driver.sqlalchemy_url == DATABASE_URL and driver.operator_key is None


def test_a_local_ray_head_does_not_inherit_the_services_settings(
        service_env, monkeypatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def fake_run(cmd: list[str], **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise SystemExit  # stop before waiting for a head that never starts

    monkeypatch.setattr(head_module.subprocess, "run", fake_run)
    with pytest.raises(SystemExit):
        head_module._start_head(8299, 1, 0)
    assert not any(name.startswith("DPTUNE_") for name in seen["env"])
    assert OPERATOR_KEY not in repr(seen["env"]) and "s3cret" not in repr(seen["env"])
