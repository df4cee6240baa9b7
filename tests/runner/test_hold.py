"""A job that holds its release keeps its cluster resources until the hold ends (issue 39,
finding 5; docs/design.md, invariant 11): its trials run one at a time in one reused process,
whose last trial waits until the control plane's hold time. With a fake clock and a fake
trial: no Ray, no torch."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import runner
from core.config import DatasetConfig
from core.plan import Plan
from core.spec import JobSpec
from runner import driver, job
from runner.client import ControlPlaneError
from runner.job import JobContext


class Clock:
    """The control plane's clock and a trial process's sleep, both fake."""

    def __init__(self, hold_s: float) -> None:
        self.now, self.until = 0.0, hold_s
        self.asked = 0

    def seconds_left(self) -> float:
        """What ``GET /internal/v1/jobs/{id}/hold`` answers."""
        self.asked += 1
        return max(self.until - self.now, 0.0)

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_the_last_trial_waits_until_the_hold_ends(hold_s, ended_s):
    """It returns — and its process frees its CPUs and GPUs — not before the control plane's
    hold time, however far off, nor later; at once when its trial ended after the hold.
    It asks again after each sleep, so that the control plane's clock alone decides."""
    clock = Clock(hold_s)
    clock.now = ended_s  # when the last trial ended, in seconds from the job's start
    job.hold(clock.seconds_left, clock.sleep)
    assert clock.now == pytest.approx(max(hold_s, ended_s), abs=1e-6)
    assert clock.now >= hold_s
    assert clock.asked <= 3


#: what a call to the control plane may raise instead of answering: no connection (the service
#: restarting), a timeout (a loaded machine), an error status (its database locked or failing
#: over, a proxy in front of it)
FAULTS = (
    lambda: httpx.ConnectError("no answer"),
    lambda: httpx.ReadTimeout("too slow"),
    lambda: ControlPlaneError("GET", "/hold", httpx.Response(500, text="database is locked")),
    lambda: ControlPlaneError("GET", "/hold", httpx.Response(503, text="restarting")),
    lambda: ControlPlaneError("GET", "/hold", httpx.Response(404, text="job 7 not found")),
)


class FlakyClock(Clock):
    """A control plane whose ``i``-th call raises ``FAULTS[faults[i]]`` (None: it answers)."""

    def __init__(self, hold_s: float, faults: list[int | None]) -> None:
        super().__init__(hold_s)
        self.faults = faults
        self.answered: float | None = None  # the last answer, None after a fault

    def seconds_left(self) -> float:
        fault = self.faults[self.asked] if self.asked < len(self.faults) else None
        self.answered = None
        if fault is not None:
            self.asked += 1
            raise FAULTS[fault]()
        self.answered = super().seconds_left()
        return self.answered


@given(
    st.floats(0, 1e6),
    st.floats(0, 1e6),
    st.lists(st.one_of(st.none(), st.integers(0, len(FAULTS) - 1)), max_size=12),
)
def test_a_control_plane_that_does_not_answer_does_not_end_the_hold(hold_s, ended_s, faults):
    """An error instead of an answer does not end the wait: the last trial's process would
    free its CPUs and GPUs before the hold's end, and another job's attempt times would tell
    K. It asks again, backing off, until the control plane says the hold is over, and so
    ends no more than the backoff's cap per failed call after the hold time."""
    clock = FlakyClock(hold_s, faults)
    clock.now = ended_s
    job.hold(clock.seconds_left, clock.sleep)
    assert clock.answered == 0.0
    assert clock.now >= hold_s
    failed = sum(f is not None for f in faults)
    assert clock.now <= max(hold_s, ended_s) + failed * job.HOLD_RETRY_MAX_S + 1e-6


def context(hold: bool, trials: int = 3) -> JobContext:
    return JobContext(
        job_id=7,
        control_url="http://control",
        token="dpr_x",
        data_dir=Path("/nonexistent"),
        spec=JobSpec.model_validate(
            {
                "dataset": 1,
                "model": {"name": "mlp"},
                "privacy": {"epsilon": 1.0, "accounting": "lt", "gamma": 0.1, "hold_release": hold},
            }
        ),
        plan=Plan.model_construct(),  # the hold reads none of it
        dataset=DatasetConfig(source="builtin:digits"),
        trials=trials,
        candidates=None,
    )


@pytest.fixture
def trials(monkeypatch) -> list[tuple[str, int]]:
    """What happens in the trial processes, in order: each trial ("ran", index) — trial 1
    raises, as a failed trial does — and each wait for the hold ("held", index)."""
    events: list[tuple[str, int]] = []

    def run_candidate(config: dict[str, Any], ctx: JobContext) -> None:
        index = job.trial_index(config)
        events.append(("ran", index))
        if index == 1:
            raise RuntimeError("the trial failed")

    fake = types.ModuleType("runner.trainable")
    fake.run_candidate = run_candidate  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "runner.trainable", fake)
    monkeypatch.setattr(runner, "trainable", fake, raising=False)
    current: list[int] = []  # the trial running now, last

    def hold(seconds_left: Any) -> None:
        assert seconds_left.__name__ == "hold_left"  # the control plane's answer
        events.append(("held", current[-1]))

    monkeypatch.setattr(job, "hold", hold)

    def run(ctx: JobContext) -> list[tuple[str, int]]:
        for index in range(ctx.trials):
            current.append(index)
            with contextlib.suppress(RuntimeError):
                job.run({"trial": {"index": index}}, ctx)
        return events

    return run  # type: ignore[return-value]


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_only_the_last_trial_of_a_holding_job_waits(trials, k):
    expected = [("ran", i) for i in range(k)] + [("held", k - 1)]
    assert trials(context(hold=True, trials=k)) == expected


def test_a_failed_last_trial_waits_too(trials):
    assert trials(context(hold=True, trials=2)) == [("ran", 0), ("ran", 1), ("held", 1)]


def test_a_job_that_does_not_hold_never_waits(trials):
    assert trials(context(hold=False, trials=3)) == [("ran", 0), ("ran", 1), ("ran", 2)]


def test_a_holding_job_runs_one_trial_at_a_time_in_one_process():
    """Side by side, K trials would take K trials' resources and free them when K is
    reached; one after another in one reused process the job keeps one trial's, whatever K,
    until its last trial's wait ends. Also when the operator turned process reuse off."""
    for reuse in (False, True):
        held = driver.tune_config(context(hold=True), reuse)
        assert held.max_concurrent_trials == 1 and held.reuse_actors
        free = driver.tune_config(context(hold=False), reuse)
        assert free.max_concurrent_trials is None and free.reuse_actors == reuse
        proxy = driver.tune_config(context(hold=True), reuse, proxy=True)
        assert proxy.max_concurrent_trials is None and proxy.reuse_actors == reuse
