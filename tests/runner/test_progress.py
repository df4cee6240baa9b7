"""An attempt's progress reaches the control plane batched (``runner.client.Progress``): the
first epoch at once, then at most every ``every_s`` seconds, and every row by the end; and
whatever values a trial's rows hold, reporting them cannot fail the trial."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from runner import trainable
from runner.client import ControlPlane, ControlPlaneError, Progress


class Recorder:
    """Stands in for :class:`runner.client.ControlPlane`: the progress calls it was given."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, int, list[dict[str, Any]]]] = []
        self.fail = fail

    def progress(self, attempt: int, steps: int, metrics: list[dict[str, Any]]) -> None:
        self.calls.append((attempt, steps, list(metrics)))
        if self.fail:
            raise ControlPlaneError("POST", "/progress", httpx.Response(500, text="down"))


def rows(epoch: int) -> list[dict[str, Any]]:
    return [{"epoch": epoch, "name": n, "value": 0.5, "public": True} for n in ("loss", "acc")]


def test_epochs_in_quick_succession_are_sent_first_and_last() -> None:
    api = Recorder()
    progress = Progress(api, attempt=7, every_s=3600)  # type: ignore[arg-type]
    sent = [progress.add(10 * e, rows(e)) for e in range(1, 17)]
    assert sent == [True] + [False] * 15
    progress.flush()
    assert [(a, s) for a, s, _ in api.calls] == [(7, 10), (7, 160)]
    # every row, each once, in order
    assert [r for _, _, m in api.calls for r in m] == [r for e in range(1, 17) for r in rows(e)]
    progress.flush()  # nothing held back: no call
    assert len(api.calls) == 2


def test_slow_epochs_are_each_sent() -> None:
    api = Recorder()
    progress = Progress(api, attempt=1, every_s=0.0)  # type: ignore[arg-type]
    assert all(progress.add(e, rows(e)) for e in range(1, 5))
    assert [s for _, s, _ in api.calls] == [1, 2, 3, 4]


def test_rows_whose_call_failed_are_not_sent_again() -> None:
    """A trial whose progress call failed ends failed; flushing then must not repeat the call
    (each is retried for minutes when the control plane does not answer)."""
    api = Recorder(fail=True)
    progress = Progress(api, attempt=1, every_s=3600)  # type: ignore[arg-type]
    with pytest.raises(ControlPlaneError):
        progress.add(1, rows(1))
    progress.flush()
    assert len(api.calls) == 1


def _control_plane(bodies: list[Any]) -> ControlPlane:
    """A real client whose calls reach a stand-in control plane that reads each body as strict
    JSON, as the service's parser does for finite numbers only, and answers 200."""

    def not_json(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content, parse_constant=not_json))
        return httpx.Response(200, json={"attempt": 1})

    api = ControlPlane("http://control", "token", job_id=1)
    api.http = httpx.Client(transport=httpx.MockTransport(answer))
    return api


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_values_json_cannot_carry_are_sent_as_null(value: float) -> None:
    """A private metric computed on a planted record (docs/design.md, invariant 13) must not
    fail the call: httpx refuses to encode NaN and ±inf."""
    bodies: list[Any] = []
    api = _control_plane(bodies)
    sent = [{"epoch": 1, "name": "train_loss", "value": value, "public": False}, *rows(1)]
    api.progress(3, 5, sent)
    assert bodies == [{"steps": 5, "metrics": [{**sent[0], "value": None}, *rows(1)]}]


class Ended(Exception):
    """How the stand-in trial ends, once it has reported its epochs."""


def test_a_trials_nan_rows_do_not_fail_its_reporting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trainable's per-epoch reporting (``runner.trainable.run_candidate``), given rows
    with NaN and ±inf private values, sends them as null and returns into the trial: what
    ends this stand-in trial is its own exception, not the encoding."""
    bodies: list[Any] = []
    api = _control_plane(bodies)
    epochs = [
        [{"epoch": e, "name": "train_loss", "value": v, "visibility": "private"}]
        for e, v in enumerate([math.nan, math.inf, -math.inf], start=1)
    ]

    def trial(cfg: Any, on_step: Any, on_epoch: Any, data_dir: Path) -> None:
        for epoch, epoch_rows in enumerate(epochs, start=1):
            on_step(epoch, len(epochs))
            on_epoch(epoch_rows)
        raise Ended

    ctx = SimpleNamespace(
        spec=SimpleNamespace(resources=SimpleNamespace(cpu=1), search_space={}),
        plan=SimpleNamespace(trial_epsilon=1.0),
        data_dir=tmp_path,
        control_plane=lambda: api,
    )
    node = SimpleNamespace(get_node_id=lambda: "ab")
    monkeypatch.setattr(trainable, "ray", SimpleNamespace(get_runtime_context=lambda: node))
    monkeypatch.setattr(trainable, "tune", SimpleNamespace(report=lambda result: None))
    monkeypatch.setattr(trainable, "trial_config", lambda ctx, params: None)
    monkeypatch.setattr(trainable, "run_trial", trial)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Ended):
            trainable.run_candidate({"trial": {"index": 0, "params": {}}}, ctx)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    progress = [b for b in bodies if "metrics" in b]
    assert [r["value"] for b in progress for r in b["metrics"]] == [None, None, None]
    assert bodies[-1] == {"status": "failed", "steps": 3, "score": None, "thresholds": None}
