"""The Python client and the CLI verbs on a real Ray cluster: submit, wait until released,
download the model."""

from __future__ import annotations

import json

from safetensors import safe_open
from typer.testing import CliRunner

from dptune import Client
from service.cli import app

from .conftest import OPERATOR, small_job


def test_client_and_cli_run_a_job_to_its_model(service, digits, tmp_path) -> None:
    url, key = str(service.client.base_url), OPERATOR["Authorization"][7:]
    with Client(url, key) as client:
        job = client.submit(small_job(digits))
        view = job.wait(timeout=240, poll_s=0.5)
        assert view.status == "released", view
        assert len(job.trials()) == 2
        with safe_open(job.download(tmp_path / "model.safetensors"), "pt") as model:
            assert model.keys()

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(small_job(digits)))
    cli = ["--url", url, "--key", key]
    submitted = CliRunner().invoke(app, ["jobs", "submit", str(spec), "--wait", "--json", *cli])
    assert submitted.exit_code == 0, submitted.stderr
    released = json.loads(submitted.stdout)
    assert released["status"] == "released"
    out = tmp_path / "cli.safetensors"
    got = CliRunner().invoke(app, ["jobs", "model", str(released["id"]), "-o", str(out), *cli])
    assert got.exit_code == 0, got.stderr
    assert out.read_bytes()[:8] and out.stat().st_size > 100
