"""Secrets stay in the control plane (issue 17, item 13; docs/design.md, invariant 10).

The attack: a Ray job's runtime environment is shown in the Ray dashboard; it carried every
``DPTUNE_*`` variable of the service — the operator key included — and the database URL with
its password. A locally started Ray head inherited them as well, and so did every trial.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from fastapi.testclient import TestClient

from runner.settings import RunnerSettings
from service.api import create_app
from service.cluster import RayConnection, RayOrchestrator, ray_jobs, ray_orchestrator
from service.cluster import head as head_module
from service.cluster.ray_jobs import namespace
from service.orchestration import OrchestratorUnavailable, Submission
from service.settings import Settings, StartupError

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
        record = head_module.choose_record().model_copy(update={"temp_dir": tmp_path / "ray"})
        head_module._start_head(record, 1, 0)
    assert not any(name.startswith("DPTUNE_") for name in seen["env"])
    assert OPERATOR_KEY not in repr(seen["env"]) and "s3cret" not in repr(seen["env"])


# ---------------------------------------------------------------- invariant 16
# The attack (issue 39, finding 7): the SQLite ledger lived in DPTUNE_DATA_DIR, which every Ray
# job receives; a process with nothing but a job's environment raised a dataset's budget.

#: what a trial does with the environment it is given: look in every path it names (and in its
#: working directory) for SQLite files, and rewrite the budget of any dptune database there
ATTACK = """
import json, os, sqlite3
found = []
named = [v for v in os.environ.values() if os.path.isabs(v) and os.path.exists(v)]
for top in {*named, os.getcwd()}:
    for root, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                if f.read(16) != b"SQLite format 3\\0":
                    continue
            found.append(path)
            db = sqlite3.connect(path, timeout=10)
            db.execute("UPDATE dataset SET epsilon = epsilon * 1000")
            db.commit()
print(json.dumps(found))
"""


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The process environment without the suite's DPTUNE_* and Ray token variables, as a copy:
    :func:`~service.cluster.head.ensure_token` exports the token into it, for this test only."""
    copy = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_", "RAY_AUTH"))}
    monkeypatch.setattr(os, "environ", copy)
    return copy


OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}


def register(client: TestClient, settings: Settings) -> int:
    """Register a small dataset (a file in the data dir) with ε = 3.5; return its id."""
    rng = np.random.default_rng(0)
    np.savez(settings.data_path / "d.npz", x=rng.normal(size=(40, 4)), y=rng.integers(0, 3, 40))
    body = {"name": "d", "source": "npz:d.npz", "num_classes": 3, "epsilon": 3.5, "delta": 1e-5}
    response = client.post("/v1/datasets", headers=OPERATOR, json=body)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def job_env(settings: Settings) -> tuple[dict[str, str], Path]:
    """What the service gives a Ray job: its runtime env's variables, and the working
    directory of a local head started by the service (where the job's driver starts)."""
    orchestrator = ray_orchestrator(settings, "http://127.0.0.1:8000")
    assert orchestrator.local_head is not None and orchestrator.local_head.cwd is not None
    env = orchestrator.runtime_env(Submission(1, "dpr_job-token", "digits"))["env_vars"]
    return env, orchestrator.local_head.cwd


def test_a_ray_jobs_environment_does_not_lead_to_the_ledger(
    environ, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the default set-up: ./.dptune, the service's own start
    settings = Settings(operator_key=OPERATOR_KEY)
    with TestClient(create_app(settings)) as client:
        dataset = register(client, settings)
        env, cwd = job_env(settings)
        attack = [sys.executable, "-c", ATTACK]
        done = subprocess.run(attack, env=env, cwd=cwd, capture_output=True, text=True, check=True)
        budget = client.get(f"/v1/datasets/{dataset}/budget", headers=OPERATOR).json()
    assert json.loads(done.stdout) == []
    assert budget["epsilon"] == 3.5
    assert (settings.state_path / "dptune.db").stat().st_size > 0  # the ledger is there


SETUPS = {
    "default": {},
    "data dir": {"DPTUNE_DATA_DIR": "{tmp}/shared/data"},
    "state dir": {"DPTUNE_DATA_DIR": "{tmp}/data", "DPTUNE_STATE_DIR": "{tmp}/private/s"},
    "relative dirs": {"DPTUNE_DATA_DIR": "x/../data", "DPTUNE_STATE_DIR": "~/../s"},
    "sqlite url": {"DPTUNE_DATABASE_URL": "sqlite:///{tmp}/private/ledger.sqlite"},
    "postgresql": {"DPTUNE_DATABASE_URL": DATABASE_URL},
    "own ray token": {"RAY_AUTH_TOKEN": "ray-token-of-the-operator"},
}


@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
def test_nothing_a_job_or_the_local_head_gets_names_the_state_dir(
    setup: dict[str, str], environ, monkeypatch, tmp_path: Path
) -> None:
    """Neither a job's runtime env nor the local head's environment (which its trials
    inherit) nor its working directory names the state dir, the database or the operator key,
    whatever the settings; the token the head gets is passed by value."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DPTUNE_OPERATOR_KEY", OPERATOR_KEY)
    for name, value in setup.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    settings = Settings()
    env, cwd = job_env(settings)
    started: dict[str, Any] = {}

    def ray_start(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        started.update(kwargs)
        return subprocess.CompletedProcess(cmd, 1, "", "not here")

    monkeypatch.setattr(head_module.subprocess, "run", ray_start)
    orchestrator = ray_orchestrator(settings, "http://127.0.0.1:8000")
    with pytest.raises(OrchestratorUnavailable):
        orchestrator.check()  # no head answers: it starts one (here: tries to)
    assert started["cwd"] == cwd == settings.data_path
    secrets = (str(settings.state_path), settings.sqlalchemy_url, OPERATOR_KEY, "s3cret")
    for values in (env.values(), started["env"].values()):
        assert not any(secret in value for value in values for secret in secrets)
    for path in (Path(env["DPTUNE_DATA_DIR"]), cwd):
        assert not settings.state_path.is_relative_to(path)
    assert "RAY_AUTH_TOKEN_PATH" not in started["env"]
    assert started["env"]["RAY_AUTH_TOKEN"] == orchestrator.connection.token


def test_the_state_dir_is_the_owners_alone(environ, tmp_path: Path) -> None:
    """0700 for the state dir, 0600 for the database, its WAL files and the Ray token,
    whatever the umask."""
    settings = Settings(data_dir=tmp_path / "data", operator_key=OPERATOR_KEY)
    umask = os.umask(0)
    try:
        with TestClient(create_app(settings)):
            ray_orchestrator(settings, "http://127.0.0.1:8000")
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in settings.state_path.iterdir()}
    finally:
        os.umask(umask)
    assert stat.S_IMODE(settings.state_path.stat().st_mode) == 0o700
    names = ("dptune.db", "dptune.db-wal", "dptune.db-shm", "ray-auth-token", "ray-head.json")
    assert modes == dict.fromkeys(names, 0o600)
    assert not any(settings.data_path.rglob("*"))  # nothing of it in the shared data dir


@pytest.mark.parametrize(
    ("data", "state", "url", "setting"),
    [
        ("d", "d/state", None, "DPTUNE_STATE_DIR"),
        ("s/data", "s", None, "DPTUNE_STATE_DIR"),
        ("d", "d", None, "DPTUNE_STATE_DIR"),
        ("d", "d/./x/..", None, "DPTUNE_STATE_DIR"),
        ("d", None, "sqlite:///{tmp}/d/my.db", "DPTUNE_DATABASE_URL"),
        ("d", None, "sqlite:///{tmp}/d/sub/../my.db", "DPTUNE_DATABASE_URL"),
    ],
)
def test_a_state_dir_or_database_in_the_data_dir_is_refused(
    data: str, state: str | None, url: str | None, setting: str, environ, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path / data,
        state_dir=tmp_path / state if state else None,
        database_url=url.format(tmp=tmp_path) if url else None,
    )
    with pytest.raises(StartupError, match=setting) as refused:
        settings.prepare_dirs()
    assert "\n" not in str(refused.value)
    assert not any(tmp_path.rglob("*.db"))


def _old_layout(settings: Settings) -> int:
    """A database and a Ray token where versions before the state dir kept them; returns
    the id of a dataset registered there."""
    with TestClient(create_app(settings)) as client:
        dataset = register(client, settings)
    for path in settings.state_path.glob("dptune.db*"):
        path.rename(settings.data_path / path.name)
    (settings.data_path / "ray").mkdir()
    (settings.data_path / "ray" / "auth_token").write_text("old-ray-token")
    shutil.rmtree(settings.state_path)
    return dataset


def test_an_older_versions_database_moves_to_the_state_dir(
    environ, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(data_dir=tmp_path / "data", operator_key=OPERATOR_KEY)
    dataset = _old_layout(settings)
    with caplog.at_level(logging.WARNING, "service.settings"):
        orchestrator = ray_orchestrator(settings, "http://127.0.0.1:8000")
        with TestClient(create_app(settings)) as client:
            budget = client.get(f"/v1/datasets/{dataset}/budget", headers=OPERATOR).json()
    assert budget["epsilon"] == 3.5
    assert not list(settings.data_path.glob("dptune.db*"))
    assert stat.S_IMODE((settings.state_path / "dptune.db").stat().st_mode) == 0o600
    # the token is copied: a Ray head started by the older version still reads the old file
    assert orchestrator.connection.token == "old-ray-token"
    moved = [r.getMessage() for r in caplog.records]
    assert len(moved) == 2 and "moved the database" in moved[0] and "Ray token" in moved[1]


def test_a_database_in_both_places_is_refused(environ, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", operator_key=OPERATOR_KEY)
    _old_layout(settings)
    (settings.state_path).mkdir()
    (settings.state_path / "dptune.db").write_bytes(b"SQLite format 3\0")
    with pytest.raises(StartupError, match="move away the one not to keep"):
        settings.prepare_dirs()
    assert (settings.data_path / "dptune.db").exists()
