"""The Python client against a real service over HTTP (SQLite, no orchestrator: jobs stay
queued)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.spec import JobSpec
from dptune import (
    ApiError,
    Client,
    Conflict,
    DptuneError,
    NotFound,
    Overloaded,
    Refused,
    Unauthorized,
)
from dptune.errors import api_error


@pytest.fixture
def op(url, operator_key):
    with Client(url, operator_key) as client:
        yield client


def test_plan_submit_list_show_cancel(op, dataset, job_spec) -> None:
    plan = op.plan(job_spec(dataset))
    assert plan.fits and plan.dataset == dataset and plan.remaining_epsilon == 2.0
    job = op.submit(job_spec(dataset), idempotency_key="k1")
    assert job.status == "queued"
    assert op.submit(job_spec(dataset), idempotency_key="k1").id == job.id  # replayed
    assert op.budget(dataset).remaining == pytest.approx(plan.remaining_epsilon_after)
    assert [j.id for j in op.jobs(status="queued", dataset=dataset)] == [job.id]
    assert op.jobs(status="released") == []
    assert op.job(job.id).view.plan.epsilon == plan.epsilon
    assert job.refresh().id == job.id and job.trials() == []
    assert job.cancel().status == "cancelled"
    assert job.wait(progress=True, timeout=5, poll_s=0.01).status == "cancelled"


def test_typed_spec_is_accepted(op, dataset, job_spec) -> None:
    spec = JobSpec.model_validate(job_spec(dataset))
    assert op.plan(spec).dataset == dataset


def test_datasets_and_keys(op, url, dataset) -> None:
    assert [d.name for d in op.datasets()] == ["digits"]
    assert op.dataset(dataset).epsilon == 2.0
    key = op.create_key("ana", "analyst", [dataset])
    assert key.secret and key.datasets == [dataset]
    with Client(url, key.secret) as ana:
        assert [d.id for d in ana.datasets()] == [dataset]
    op.revoke_key(key.id)
    listed = op.keys()
    assert [k.revoked_at is not None for k in listed if k.id == key.id] == [True]
    with Client(url, key.secret) as ana, pytest.raises(Unauthorized):
        ana.datasets()


def test_defaults_come_from_the_environment(monkeypatch, url, operator_key, dataset) -> None:
    monkeypatch.setenv("DPTUNE_URL", url)
    monkeypatch.setenv("DPTUNE_API_KEY", operator_key)
    with Client() as client:
        assert client.url == url and client.dataset(dataset).id == dataset


@pytest.mark.parametrize(
    ("change", "kind", "status", "field"),
    [
        (lambda s: s | {"epochs": 0}, Refused, 422, "epochs"),
        (lambda s: s | {"batch_size": "x"}, Refused, 422, "batch_size"),
        (
            lambda s: {**s, "privacy": {"epsilon": -1.0, "accounting": "rdp"}},
            Refused,
            422,
            "privacy.epsilon",
        ),
        (
            lambda s: {**s, "privacy": {"epsilon": 50.0, "accounting": "rdp"}},
            Conflict,
            409,
            "privacy.epsilon",
        ),
        (lambda s: s | {"dataset": 999}, NotFound, 404, None),
    ],
)
def test_errors_name_the_field(op, dataset, job_spec, change, kind, status, field) -> None:
    with pytest.raises(kind) as caught:
        op.submit(change(job_spec(dataset)))
    error = caught.value
    assert isinstance(error, ApiError) and error.status == status
    if field is not None:
        assert error.field == field, error.body
    assert error.message and error.body


def test_no_key_and_unknown_ids(url, op) -> None:
    with Client(url, "dpt_wrong-key-0123456789012345") as client, pytest.raises(Unauthorized):
        client.datasets()
    with pytest.raises(NotFound):
        op.job(12345)
    with pytest.raises(NotFound):
        op.revoke_key(12345)


def test_download_before_release_is_a_conflict(op, dataset, job_spec, tmp_path) -> None:
    job = op.submit(job_spec(dataset))
    with pytest.raises(Conflict) as caught:
        job.download(tmp_path / "model.safetensors")
    assert caught.value.field == "job"
    assert not (tmp_path / "model.safetensors").exists()
    assert job.report(tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")


def test_wait_times_out(op, dataset, job_spec) -> None:
    job = op.submit(job_spec(dataset))
    with pytest.raises(DptuneError, match="still queued"):
        job.wait(timeout=0, poll_s=0.01)


def test_unreachable_service() -> None:
    with Client("http://127.0.0.1:9", "k") as client, pytest.raises(DptuneError, match="reach"):
        client.datasets()


@pytest.mark.parametrize("status", [429, 503])
def test_overloaded_carries_retry_after(status) -> None:
    error = api_error(status, {"detail": "busy"}, "7")
    assert isinstance(error, Overloaded) and error.retry_after == 7.0
    assert error.field is None and error.message == "busy"


def test_the_client_imports_no_engine_or_service() -> None:
    code = (
        "import dptune, sys; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'ray', 'sqlalchemy', 'service', 'workers', 'runner', 'fastapi'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
