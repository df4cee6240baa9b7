"""Where admitted jobs run. The control plane talks to an :class:`Orchestrator`; the Ray
implementation (Ray Jobs + Tune) plugs in here.

The default, :class:`NullOrchestrator`, runs nothing: admitted jobs stay ``queued`` until
cancelled. It exists so that the API, the budget and the tests work without a cluster.

An orchestrator that does not answer (its cluster is down, restarting or out of reach) raises
:class:`OrchestratorUnavailable`: what it runs is then *unknown*, never *lost* — the control
plane keeps serving, leaves its jobs as they are and asks again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # ran to the end, but released no model (no trial finished)
    RELEASED = "released"  # ran to the end and released the best trial's model
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: reported by an orchestrator that answered and has no record of the job (e.g. the Ray
    #: cluster was replaced while the service was down) — never for one that did not answer;
    #: recorded as ``failed`` with the job's whole reservation charged, since what it touched
    #: is unknown
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


class OrchestratorUnavailable(Exception):
    """The orchestrator did not answer, so the state of its jobs is unknown right now (not
    lost: nothing may be settled on it). The message is one line that names no address or
    credential: it is shown on the unauthenticated ``/healthz``."""


@dataclass(frozen=True)
class Submission:
    """What an orchestrator hands to a job's runner: the job's id and its runner token. The
    runner reads the admitted spec and plan, and records its trials, through the control
    plane's internal API (:mod:`service.api.runner`) with that token — attempts recorded, and
    charged, before they read data."""

    job_id: int
    token: str
    dataset_name: str
    #: how the cluster's job list names the job (nothing secret, nothing that depends on K)
    title: str = ""
    #: what each trial asks of one node (the spec's ``resources``: ``cpu``, ``gpu``); an
    #: orchestrator refuses a job that no node of its cluster can ever run
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    """What one live node of the cluster has in all (not what is free now): a trial runs on
    one node, so a trial that asks more than every node has can never start."""

    cpu: float
    gpu: float


class Orchestrator(Protocol):
    """Runs admitted jobs; ``dashboard_url`` is where an operator watches them, if anywhere.
    Contract: a job's code reads the dataset only inside trial attempts recorded beforehand
    through the internal API (``POST /internal/v1/jobs/{id}/attempts``, which refuses attempts
    the reservation does not cover); the ledger charges exactly those attempts (invariant 3)."""

    @property
    def dashboard_url(self) -> str | None: ...

    def check(self) -> None:
        """Return when the orchestrator answers; raise :class:`OrchestratorUnavailable` when
        it does not (the service's poller calls this before each round)."""

    def submit(self, submission: Submission) -> None:
        """Start the job (asynchronously). Called after its reservation is committed.
        Idempotent per job id: a job the orchestrator already has counts as submitted. Raises
        :class:`OrchestratorUnavailable` when it does not answer (the job is tried again
        later); any other error means it refused the job."""

    def status(self, job_id: int) -> JobState:
        """Current state of a submitted job: :attr:`JobState.LOST` when the orchestrator
        answers that it has no record of it, :class:`OrchestratorUnavailable` when it does not
        answer."""

    def cancel(self, job_id: int) -> None:
        """Ask the job to stop; :meth:`status` reports when it has. Raises
        :class:`OrchestratorUnavailable` when the request could not be delivered."""

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        """The state of each of these submitted jobs (as :meth:`status`), leaving out those
        whose state is unknown right now because the orchestrator did not answer."""


@runtime_checkable
class Inspectable(Protocol):
    """An orchestrator that can also tell what its cluster has and says of a job: for
    admission (:mod:`service.admission`) and operators (a job's log, why it waits). Each call
    raises :class:`OrchestratorUnavailable` when the cluster does not answer."""

    def nodes(self) -> list[Node]:
        """The live nodes of the cluster, with what each has in all."""

    def message(self, job_id: int) -> str | None:
        """What the cluster says of a submitted job's state (why it is pending, why it
        failed); None when it says nothing. May quote the job's output: operators only."""

    def logs(self, job_id: int) -> str:
        """The job's driver log so far; "" for a job the cluster has no record of."""


@dataclass
class NullOrchestrator:
    """Accepts jobs and never runs them (no trial touches data): they stay ``queued`` until
    cancelled. The default until a real orchestrator is configured."""

    cancelled: set[int] = field(default_factory=set)
    dashboard_url: str | None = None

    def check(self) -> None:
        pass

    def submit(self, submission: Submission) -> None:
        pass

    def status(self, job_id: int) -> JobState:
        return JobState.CANCELLED if job_id in self.cancelled else JobState.QUEUED

    def cancel(self, job_id: int) -> None:
        self.cancelled.add(job_id)

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {job_id: self.status(job_id) for job_id in job_ids}
