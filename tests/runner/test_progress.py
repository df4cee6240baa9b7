"""An attempt's progress reaches the control plane batched (``runner.client.Progress``): the
first epoch at once, then at most every ``every_s`` seconds, and every row by the end."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from runner.client import ControlPlaneError, Progress


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
