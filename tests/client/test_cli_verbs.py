"""The CLI verbs (``dptune jobs|budget|datasets|keys``) against a real service over HTTP."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from service.cli import app

runner = CliRunner()


@pytest.fixture
def dptune(url, operator_key):
    """Run ``dptune ARGS --url URL --key KEY``; returns (exit code, stdout, stderr)."""

    def run(*args: str, key: str = operator_key) -> tuple[int, str, str]:
        result = runner.invoke(app, [*args, "--url", url, "--key", key])
        return result.exit_code, result.stdout, result.stderr

    return run


def parsed(outcome: tuple[int, str, str]):
    code, out, err = outcome
    assert code == 0, err
    return json.loads(out)


def test_jobs_verbs(dptune, dataset, job_spec, tmp_path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job_spec(dataset)))
    job = parsed(dptune("jobs", "submit", str(spec), "--idempotency-key", "a", "--json"))
    assert job["status"] == "queued" and job["dataset"] == dataset
    again = parsed(dptune("jobs", "submit", str(spec), "--idempotency-key", "a", "--json"))
    assert again["id"] == job["id"]
    listed = parsed(dptune("jobs", "list", "--dataset", str(dataset), "--json"))
    assert [j["id"] for j in listed] == [job["id"]]
    assert parsed(dptune("jobs", "list", "--status", "released", "--json")) == []
    assert parsed(dptune("jobs", "show", str(job["id"]), "--json"))["id"] == job["id"]
    assert parsed(dptune("jobs", "trials", str(job["id"]), "--json")) == []
    budget = parsed(dptune("budget", str(dataset), "--json"))
    # the dataset counts the job through its filter: more than its own ε (the conversion)
    assert job["plan"]["epsilon"] < budget["reserved"] <= budget["epsilon"]
    assert parsed(dptune("jobs", "cancel", str(job["id"]), "--json"))["status"] == "cancelled"
    code, out, _ = dptune("jobs", "show", str(job["id"]))
    assert code == 0 and "cancelled" in out  # the table
    code, out, _ = dptune("jobs", "logs", str(job["id"]))
    assert code == 0 and out == ""  # never handed to a cluster


def test_datasets_and_keys_verbs(dptune, dataset) -> None:
    assert [d["id"] for d in parsed(dptune("datasets", "list", "--json"))] == [dataset]
    assert parsed(dptune("datasets", "show", str(dataset), "--json"))["name"] == "digits"
    key = parsed(
        dptune("keys", "create", "ana", "--role", "analyst", "--dataset", str(dataset), "--json")
    )
    assert key["secret"] and key["datasets"] == [dataset]
    assert parsed(dptune("datasets", "list", "--json", key=key["secret"]))[0]["id"] == dataset
    assert key["id"] in [k["id"] for k in parsed(dptune("keys", "list", "--json"))]
    code, out, _ = dptune("keys", "revoke", str(key["id"]))
    assert code == 0 and "revoked" in out
    code, out, _ = dptune("keys", "list")
    assert code == 0 and "ana" in out


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("jobs", "show", "999"), "dptune: "),
        (("budget", "999"), "dptune: "),
        (("keys", "create", "x", "--role", "analyst", "--dataset", "999"), "dptune: datasets"),
        (("keys", "create", "x", "--role", "root"), "dptune: role: "),
        (("jobs", "model", "999", "-o", "m.safetensors"), "dptune: "),
    ],
)
def test_an_api_error_is_one_line_and_exit_1(dptune, dataset, args, line) -> None:
    code, out, err = dptune(*args)
    assert code == 1 and out == ""
    assert err.startswith(line) and err.count("\n") == 1, err


def test_refused_spec_names_its_field(dptune, dataset, job_spec, tmp_path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job_spec(dataset) | {"epochs": 0}))
    code, _, err = dptune("jobs", "submit", str(spec))
    assert code == 1 and err.startswith("dptune: epochs: ")
    spec.write_text(json.dumps(job_spec(dataset, epsilon=50.0)))
    code, _, err = dptune("jobs", "submit", str(spec))
    assert code == 1 and err.startswith("dptune: privacy.epsilon: ")


def test_a_wrong_key_exits_1(dptune, dataset) -> None:
    code, _, err = dptune("datasets", "list", key="dpt_wrong-key-0123456789012345")
    assert code == 1 and err.startswith("dptune: ")


@pytest.mark.parametrize(
    "args", [("jobs", "show", "x"), ("jobs", "show", "0"), ("keys", "create", "x"), ("budget",)]
)
def test_usage_errors_exit_2(dptune, args) -> None:
    assert dptune(*args)[0] == 2


def test_a_spec_that_is_not_json_is_a_usage_error(dptune, tmp_path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text("{not json")
    code, _, err = dptune("jobs", "submit", str(spec))
    assert code == 2 and "not JSON" in err
