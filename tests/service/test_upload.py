"""Operator uploads of datasets: announced, streamed, checked as trials read them, installed
once (issue 16).

Attacks and accidents stopped here: a hostile record (NaN) or an out-of-range label reaching
training through an upload; an upload that fails half-way leaving a dataset or a file behind;
an analyst uploading data; a second upload replacing the data a budget was spent on; a job
planned on a dataset that has no data yet.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors
from sqlalchemy.orm import Session

from core.config import TrialConfig
from service.api import create_app
from service.api.datasets import UPLOAD_PATHS, UPLOADS, _install
from service.api.limits import BodyLimit
from service.api.runner import dataset_config
from service.db import Dataset, create_db_engine
from service.orchestration import JobState, Submission
from service.settings import Settings
from workers.data import content_sha256, load_dataset
from workers.trial import run_trial

from .conftest import OPERATOR_KEY, Api, bearer, make_spec


def _frame(n: int = 120, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    return pd.DataFrame(
        {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "d": x[:, 3], "target": (x[:, 0] > 0) * 2}
    )


def _file(kind: str, frame: pd.DataFrame) -> bytes:
    out = io.BytesIO()
    if kind == "csv":
        frame.to_csv(out, index=False)
    elif kind == "parquet":
        frame.to_parquet(out, index=False)
    else:
        x = frame.drop(columns="target").to_numpy(np.float32)
        np.savez(out, x=x, y=frame["target"].to_numpy())
    return out.getvalue()


def _announce(api: Api, kind: str = "csv", name: str = "mine", **extra) -> dict:
    options = {} if kind == "npz" else {"label": "target"}
    body = {
        "name": name,
        "source": "upload",
        "format": kind,
        "options": options,
        "num_classes": 3,
        "epsilon": 4.0,
        "delta": 1e-5,
    }
    r = api.client.post("/v1/datasets", headers=api.operator, json=body | extra)
    assert r.status_code == 201, r.text
    return r.json()


def _put(api: Api, dataset: int, content, headers=None):
    return api.client.put(
        f"/v1/datasets/{dataset}/data", headers=headers or api.operator, content=content
    )


def _row(settings: Settings, dataset: int) -> Dataset:
    with Session(create_db_engine(settings.sqlalchemy_url)) as session:
        row = session.get(Dataset, dataset)
        assert row is not None
        return row


def _left_in_uploads(settings: Settings) -> list[str]:
    folder = settings.data_path / UPLOADS
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _still_awaiting(api: Api, settings: Settings, dataset: int) -> None:
    seen = api.client.get(f"/v1/datasets/{dataset}", headers=api.operator).json()
    assert seen["awaiting_data"] and seen["n"] == 0 and seen["input_shape"] == []
    assert _row(settings, dataset).content_sha256 == ""
    assert _left_in_uploads(settings) == []  # neither the file nor a partial one


@pytest.mark.parametrize("kind", ["npz", "csv", "parquet"])
def test_upload_registers_the_data_as_trials_read_it(api, settings, kind) -> None:
    announced = _announce(api, kind)
    assert announced["awaiting_data"] and announced["n"] == 0
    assert announced["source"] == f"{kind}:{UPLOADS}/{announced['id']}.{kind}"
    data = _file(kind, _frame())

    r = _put(api, announced["id"], data)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["n"], out["input_shape"], out["num_classes"]) == (120, [4], 3)
    assert not out["awaiting_data"] and not out["public_validation"]
    assert (out["file_bytes"], out["file_sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert _left_in_uploads(settings) == [f"{announced['id']}.{kind}"]
    row = _row(settings, announced["id"])
    loaded = load_dataset(dataset_config(row), settings.data_path)  # as the runner's trials do
    assert row.content_sha256 == content_sha256(loaded) and loaded.size == 120


def test_upload_body_over_the_limit_is_refused_and_nothing_is_registered(
    tmp_path, database_url
) -> None:
    settings = Settings(
        data_dir=tmp_path, database_url=database_url, operator_key=OPERATOR_KEY
    ).model_copy(update={"max_upload_bytes": 2000})
    with TestClient(create_app(settings)) as client:
        api = Api(client, bearer(OPERATOR_KEY))
        dataset = _announce(api)["id"]
        data = _file("csv", _frame())
        assert len(data) > 2000
        r = _put(api, dataset, data)  # Content-Length says so up front
        assert r.status_code == 413 and "2000 bytes" in r.json()["detail"]
        _still_awaiting(api, settings, dataset)

        chunks = (data[i : i + 500] for i in range(0, len(data), 500))  # chunked: no length
        r = _put(api, dataset, chunks)
        assert r.status_code == 413, r.text
        _still_awaiting(api, settings, dataset)

        small = _file("csv", _frame(n=20))
        assert len(small) <= 2000
        assert _put(api, dataset, iter([small[:900], small[900:]])).status_code == 200


def test_a_non_finite_record_is_refused_naming_its_row(api, settings) -> None:
    dataset = _announce(api)["id"]
    frame = _frame()
    frame.loc[17, "c"] = np.nan
    r = _put(api, dataset, _file("csv", frame))
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    assert error["field"] == "body" and "x[17]" in error["message"]
    _still_awaiting(api, settings, dataset)

    table = _announce(api, "parquet", name="table")["id"]
    frame.loc[17, "c"] = 1e39  # beyond float32: inf once converted
    r = _put(api, table, _file("parquet", frame))
    assert r.status_code == 422 and "x[17]" in r.json()["detail"]
    _still_awaiting(api, settings, table)


def test_a_bad_label_column_is_refused_naming_it(api, settings) -> None:
    missing = _announce(api, options={"label": "class"})["id"]
    r = _put(api, missing, _file("csv", _frame()))
    assert r.status_code == 422, r.text
    error = r.json()["errors"][0]
    assert error["field"] == "options.label" and "'class'" in error["message"]
    _still_awaiting(api, settings, missing)

    dataset = _announce(api, name="other")["id"]
    frame = _frame().astype({"target": object})
    frame.loc[3, "target"] = "cat"
    r = _put(api, dataset, _file("csv", frame))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "options.label"
    assert "'target'" in r.json()["detail"] and "y[3] is 'cat'" in r.json()["detail"]

    frame = _frame()
    frame.loc[5, "target"] = 3  # outside the declared label set 0…2
    r = _put(api, dataset, _file("csv", frame))
    assert r.status_code == 422 and "y[5] = 3" in r.json()["detail"]

    r = _put(api, dataset, b"\x00garbage, not a table\n\xff\xfe")
    assert r.status_code == 422 and r.json()["detail"].startswith("body: cannot load")
    _still_awaiting(api, settings, dataset)


def test_analysts_cannot_upload(api, settings) -> None:
    dataset = _announce(api)["id"]
    ana = api.analyst(dataset)
    assert ana["Authorization"] != api.operator["Authorization"]
    r = _put(api, dataset, _file("csv", _frame()), headers=ana)
    assert r.status_code == 403, r.text
    assert _put(api, dataset, b"x", headers=bearer("dpt_not-a-key")).status_code == 401
    _still_awaiting(api, settings, dataset)


def test_a_second_upload_is_refused(api, settings) -> None:
    dataset = _announce(api)["id"]
    first = _file("csv", _frame())
    assert _put(api, dataset, first).status_code == 200
    recorded = _row(settings, dataset).content_sha256
    r = _put(api, dataset, _file("csv", _frame(seed=1)))
    assert r.status_code == 409, r.text
    assert "reset the privacy accounting" in r.json()["detail"]
    assert _row(settings, dataset).content_sha256 == recorded
    assert (settings.data_path / UPLOADS / f"{dataset}.csv").read_bytes() == first
    builtin = api.register()["id"]  # data from registration: no upload either
    assert _put(api, builtin, first).status_code == 409
    assert _put(api, 999, first).status_code == 404


def test_of_two_concurrent_uploads_one_is_installed(api, settings) -> None:
    """Both passed the check before streaming; the claim of the dataset row decides, and the
    loser never moves its file over the winner's."""
    announced = _announce(api)
    row = _row(settings, announced["id"])
    values = {"n": 1, "input_shape": [4], "public_validation": False}
    target = settings.data_path / UPLOADS / f"{row.id}.csv"
    target.parent.mkdir()
    partials = [target.with_name(f".upload-{i}.csv") for i in range(2)]
    for i, partial in enumerate(partials):
        partial.write_text(f"upload {i}")
    sessions = api.client.app.state.sessions
    outcomes: list[int] = []

    def install(i: int) -> None:
        try:
            _install(sessions, row, values | {"content_sha256": f"{i}" * 64}, partials[i], target)
            outcomes.append(200)
        except Exception as error:  # the 409 HTTPException
            outcomes.append(error.status_code)  # type: ignore[attr-defined]

    threads = [threading.Thread(target=install, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == [200, 409]
    winner = _row(settings, row.id).content_sha256[0]
    assert target.read_text() == f"upload {winner}"


def test_jobs_wait_for_the_data(api, settings, spec) -> None:
    dataset = _announce(api)["id"]
    ana = api.analyst(dataset)
    for path in ("/v1/plans", "/v1/jobs"):
        r = api.client.post(path, headers=ana, json=spec(dataset))
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "dataset" and "awaits" in r.json()["detail"]
    budget = api.budget(dataset)
    assert budget["spent"] == budget["reserved"] == 0 and budget["entries"] == []

    assert _put(api, dataset, _file("csv", _frame(n=400))).status_code == 200
    plan = api.client.post("/v1/plans", headers=ana, json=spec(dataset))
    assert plan.status_code == 200, plan.text
    assert plan.json()["sample_rate"] == pytest.approx(64 / 400)
    assert api.client.post("/v1/jobs", headers=ana, json=spec(dataset)).status_code == 202


@pytest.mark.parametrize(
    "change, field",
    [
        ({"format": None}, "format"),
        ({"source": "builtin:digits"}, "format"),
        ({"options": {}}, "options.label"),
        ({"options": {"label": "target", "features": ["a", "a"]}}, "options.features"),
        ({"options": {"label": "target", "sep": ";"}}, "options.sep"),
        ({"num_classes": None}, "num_classes"),
    ],
)
def test_an_announcement_is_checked_before_any_data(api, change, field) -> None:
    body = {
        "name": "mine",
        "source": "upload",
        "format": "csv",
        "options": {"label": "target"},
        "num_classes": 3,
        "epsilon": 4.0,
        "delta": 1e-5,
    }
    r = api.client.post("/v1/datasets", headers=api.operator, json=body | change)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == field, r.text
    assert api.client.get("/v1/datasets", headers=api.operator).json() == []


def test_table_files_in_the_data_dir_register_too(api, settings) -> None:
    _frame().to_csv(settings.data_path / "mine.csv", index=False)
    body = {"options": {"label": "target", "features": ["b", "a"]}, "num_classes": 3}
    dataset = api.register("mine", source="csv:mine.csv", **body)
    assert (dataset["n"], dataset["input_shape"], dataset["awaiting_data"]) == (120, [2], False)
    (settings.data_path / UPLOADS).mkdir()
    _frame().to_csv(settings.data_path / UPLOADS / "7.csv", index=False)
    r = api.client.post(
        "/v1/datasets",
        headers=api.operator,
        json={"name": "x", "source": f"csv:{UPLOADS}/7.csv", "epsilon": 1, "delta": 1e-5} | body,
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "source", r.text


def test_a_trial_trains_on_an_uploaded_csv(api, settings) -> None:
    dataset = _announce(api)["id"]
    assert _put(api, dataset, _file("csv", _frame(n=300))).status_code == 200
    cfg = TrialConfig(
        dataset=dataset_config(_row(settings, dataset)),  # the contract the runner hands out
        model={"name": "logreg"},
        batch_size=32,
        epochs=2,
        noise_multiplier=1.0,
        optimizer={"lr": 0.5},
        validation={"split": "private", "noise": 1.0},
        device="cpu",
    )
    outcome = run_trial(cfg, data_dir=settings.data_path)
    assert outcome.result["steps"] == round(2 * 300 / 32)
    assert outcome.result["sample_rate"] == pytest.approx(32 / 300)
    data = load_dataset(cfg.dataset, settings.data_path)
    with torch.no_grad():
        accuracy = (outcome.model(data.x).argmax(1) == data.y).float().mean()
    assert accuracy > 0.8  # it learned the label, which is the sign of column a
    (settings.data_path / UPLOADS / f"{dataset}.csv").write_bytes(_file("csv", _frame(n=301)))
    with pytest.raises(ValueError, match=r"dataset\.sha256"):
        run_trial(cfg, data_dir=settings.data_path)


def test_upload_bodies_reach_the_handler_as_they_arrive() -> None:
    """Uploads are never held whole in memory: the handler gets each piece as it comes, though
    together they exceed the limit of other bodies, until they exceed the upload limit."""

    async def handler(scope, receive, send) -> None:
        while True:
            message = await receive()
            seen.append(len(message["body"]))
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def run(pieces: list[int]) -> int:
        incoming = [
            {"type": "http.request", "body": b"x" * size, "more_body": i < len(pieces) - 1}
            for i, size in enumerate(pieces)
        ]
        sent: list[dict] = []

        async def receive() -> dict:
            return incoming.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/datasets/3/data", "headers": []}
        middleware = BodyLimit(
            handler, max_bytes=10, streamed_paths=UPLOAD_PATHS, streamed_bytes=100
        )
        asyncio.run(middleware(scope, receive, send))
        return sent[0]["status"]

    seen: list[int] = []
    assert run([40, 40, 20]) == 200 and seen == [40, 40, 20]
    seen.clear()
    assert run([40, 40, 40]) == 413 and seen == [40, 40]  # the third never reaches it


# The runner's upload of released weights (``service.api.runner.upload_model``): an imported
# model's weights are exactly the state its factory built at admission (``plan.model.state``,
# docs/design.md, invariant 14), or nothing is released.

RECORDER = {"name": "dptune_test_models:recorder", "options": {"keep": "sparse_buffer"}}
#: the state of ``recorder`` on digits [1, 8, 8] → 10 classes, as the factory builds it
BUILT = {
    "1.stat": np.zeros(64, np.float32),
    "2.weight": np.ones((10, 64), np.float32),
    "2.bias": np.ones(10, np.float32),
}


@dataclass
class KeptTokens:
    """An orchestrator that keeps the runner token of each job it is handed (the Ray path is
    in tests/e2e)."""

    tokens: dict[int, str] = field(default_factory=dict)
    dashboard_url: str | None = None

    def submit(self, submission: Submission) -> None:
        self.tokens[submission.job_id] = submission.token

    def status(self, job_id: int) -> JobState:
        return JobState.QUEUED

    def cancel(self, job_id: int) -> None:
        pass

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {}


@pytest.fixture
def own_model_job(monkeypatch, tmp_path, database_url) -> Iterator[tuple[Api, int, str, dict]]:
    """A finished job of an allow-listed model: the API, the job, its runner's path and
    headers (its one trial succeeded)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "models_pkg"))
    monkeypatch.setenv("DPTUNE_MODEL_IMPORTS", '["dptune_test_models"]')
    settings = Settings(data_dir=tmp_path, database_url=database_url, operator_key=OPERATOR_KEY)
    orchestrator = KeptTokens()
    with TestClient(create_app(settings, orchestrator)) as client:
        api = Api(client, bearer(OPERATOR_KEY))
        spec = make_spec(api.register()["id"]) | {"model": RECORDER, "search_space": {}}
        job = client.post("/v1/jobs", headers=api.operator, json=spec)
        assert job.status_code == 202, job.text
        assert job.json()["plan"]["model"]["state"].keys() == BUILT.keys()
        job_id = job.json()["id"]
        base, auth = f"/internal/v1/jobs/{job_id}", bearer(orchestrator.tokens[job_id])
        attempt = client.post(f"{base}/attempts", headers=auth, json={"index": 0, "params": {}})
        finished = {"status": "succeeded", "steps": 3, "score": 0.5}
        path = f"{base}/attempts/{attempt.json()['attempt']}/finish"
        assert client.post(path, headers=auth, json=finished).status_code == 204
        yield api, job_id, base, auth


def _unlike_the_model() -> list[tuple[str, dict[str, np.ndarray]]]:
    extra = BUILT | {"1.seen": np.full(64, 3906, np.float32)}  # a buffer added in training
    missing = {k: v for k, v in BUILT.items() if k != "1.stat"}
    reshaped = BUILT | {"1.stat": np.zeros((8, 8), np.float32)}
    retyped = BUILT | {"2.bias": np.ones(10, np.float64)}
    return [
        ("['1.seen'] are not in its state", extra),
        ("[] are not in its state, ['1.stat'] are missing", missing),
        ("tensor '1.stat' is float32 [8, 8], the model's is float32 [64]", reshaped),
        ("tensor '2.bias' is float64 [10], the model's is float32 [10]", retyped),
    ]


def test_weights_that_are_not_the_admitted_models_state_are_refused(own_model_job) -> None:
    api, job, base, auth = own_model_job
    for message, tensors in _unlike_the_model():
        r = api.client.put(f"{base}/trials/0/model", headers=auth, content=save_tensors(tensors))
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "body" and message in r.json()["detail"]
        released = api.client.get(f"/v1/jobs/{job}/model", headers=api.operator)
        assert released.status_code == 409  # nothing released
    r = api.client.put(f"{base}/trials/0/model", headers=auth, content=save_tensors(BUILT))
    assert r.status_code == 201, r.text
    released = api.client.get(f"/v1/jobs/{job}/model", headers=api.operator)
    assert load_tensors(released.content).keys() == BUILT.keys()
