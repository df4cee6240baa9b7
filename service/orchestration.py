"""Where admitted jobs run. The control plane talks to an :class:`Orchestrator`; the Ray
implementation (Ray Jobs + Tune) plugs in here.

The default, :class:`NullOrchestrator`, runs nothing: admitted jobs stay ``queued`` until
cancelled. It exists so that the API, the budget and the tests work without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # ran to the end, but released no model (no trial finished)
    RELEASED = "released"  # ran to the end and released the best trial's model
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: reported by an orchestrator for a job it has no record of (e.g. the Ray cluster was
    #: replaced while the service was down); recorded as ``failed`` with the job's whole
    #: reservation charged, since what it touched is unknown
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        return self in {
            JobState.SUCCEEDED,
            JobState.RELEASED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.LOST,
        }


@dataclass(frozen=True)
class Submission:
    """What an orchestrator hands to a job's runner: the job's id and its runner token. The
    runner reads the admitted spec and plan, and records its trials, through the control
    plane's internal API (:mod:`service.api.runner`) with that token — attempts recorded, and
    charged, before they read data."""

    job_id: int
    token: str
    dataset_name: str


class Orchestrator(Protocol):
    """Runs admitted jobs; ``dashboard_url`` is where an operator watches them, if anywhere.
    Contract: a job's code reads the dataset only inside trial attempts recorded beforehand
    through the internal API (``POST /internal/v1/jobs/{id}/attempts``, which refuses attempts
    the reservation does not cover); the ledger charges exactly those attempts (invariant 3)."""

    @property
    def dashboard_url(self) -> str | None: ...

    def submit(self, submission: Submission) -> None:
        """Start the job (asynchronously). Called after its reservation is committed."""

    def status(self, job_id: int) -> JobState:
        """Current state of a submitted job."""

    def cancel(self, job_id: int) -> None:
        """Ask the job to stop; :meth:`status` reports when it has."""

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        """After a restart: the state of every job the database believes is queued or running
        (jobs the orchestrator does not know about are reported ``failed``)."""


@dataclass
class NullOrchestrator:
    """Accepts jobs and never runs them (no trial touches data): they stay ``queued`` until
    cancelled. The default until a real orchestrator is configured."""

    cancelled: set[int] = field(default_factory=set)
    dashboard_url: str | None = None

    def submit(self, submission: Submission) -> None:
        pass

    def status(self, job_id: int) -> JobState:
        return JobState.CANCELLED if job_id in self.cancelled else JobState.QUEUED

    def cancel(self, job_id: int) -> None:
        self.cancelled.add(job_id)

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {job_id: self.status(job_id) for job_id in job_ids}
