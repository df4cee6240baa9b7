"""Each admitted tuning job runs as one Ray job whose entrypoint is the runner's driver
``python -m runner <id>`` (Ray Tune inside); the dashboard's Jobs view shows it, with its
logs, under the submission id ``dptune-<db>-job-<id>`` (``<db>`` tells apart the databases
that share a cluster: job ids are only unique within one)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from service.admission import misfit
from service.cluster.head import LocalHead, RayConnection, connection_to, probe
from service.orchestration import JobState, Node, OrchestratorUnavailable, Submission
from service.settings import Settings, StartupError

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATES = {
    JobStatus.PENDING: JobState.QUEUED,
    JobStatus.RUNNING: JobState.RUNNING,
    JobStatus.STOPPED: JobState.CANCELLED,
    JobStatus.SUCCEEDED: JobState.SUCCEEDED,
    JobStatus.FAILED: JobState.FAILED,
}


class _NoSuchJob(Exception):
    """The Jobs API answered 404: it has no record of the job."""


class SubmissionRefused(Exception):
    """The Jobs API answered a submission with a client error (4xx): the job cannot run."""


_HTTP_STATUS = re.compile(r"status code (\d{3})")


def _http_status(error: RuntimeError) -> int | None:
    found = _HTTP_STATUS.search(str(error))
    return int(found.group(1)) if found else None


def _jobs_api(call: Callable[[], T]) -> T:
    """Run one call of Ray's ``JobSubmissionClient`` and say what its failure means.

    The SDK signals "no answer" as an ``OSError`` (requests' ``ConnectionError`` and
    ``Timeout``; its own ``ConnectionError`` when a client is created) and every HTTP answer
    other than 200 as ``RuntimeError("Request failed with status code N: <body>")``. Only
    Ray's own 404 ("Job … does not exist") says the cluster has no record of a job
    (:class:`_NoSuchJob`): any other answer — a 5xx, a 404 from something else at that
    address, a refused token — like no answer leaves the job's state unknown
    (:class:`OrchestratorUnavailable`), so an outage can never be read as a lost job and
    charged as one."""
    try:
        return call()
    except OSError as error:
        raise OrchestratorUnavailable(
            f"no answer from the Ray Jobs API ({type(error).__name__})"
        ) from None
    except AuthenticationError:
        raise OrchestratorUnavailable("the Ray Jobs API refused the Ray auth token") from None
    except RuntimeError as error:
        code = _http_status(error)
        if code == 404 and "does not exist" in str(error):
            raise _NoSuchJob from None
        raise OrchestratorUnavailable(
            f"the Ray Jobs API answered {f'HTTP {code}' if code else 'with an error'}"
        ) from None


@dataclass
class RayOrchestrator:
    """Runs jobs on the cluster behind ``connection``. A job's runner reports to the control
    plane at ``control_url`` with the job's token; it holds no database credentials.

    A Ray job's runtime environment is visible to anyone who can open the Ray dashboard, so it
    carries an explicit allow-list (:meth:`runtime_env`): where the control plane is, the job's
    token (good for recording that job's own trials only, never for reducing a charge), the
    data directory — never the operator key, the database URL, the state dir or any other
    ``DPTUNE_*`` setting of the service (invariants 10 and 16). ``namespace`` tells apart the
    control planes (databases) that share a cluster.

    Nothing is contacted until a job needs it, so the service starts while the cluster is
    down; ``local_head`` (the embedded default) is started by :meth:`check` when it does not
    answer."""

    connection: RayConnection
    control_url: str
    data_dir: Path
    namespace: str
    local_head: LocalHead | None = None
    reuse_processes: bool = True  # Settings.reuse_trial_processes
    check_resources: bool = True  # Settings.ray_check_resources
    _client: JobSubmissionClient | None = field(default=None, init=False, repr=False)

    @property
    def client(self) -> JobSubmissionClient:
        """Ray's client, created on first use (creating one asks the cluster its version)."""
        if self._client is None:
            self._client = _jobs_api(
                lambda: JobSubmissionClient(
                    self.connection.dashboard_url, headers=self.connection.headers
                )
            )
        return self._client

    def runtime_env(self, submission: Submission) -> dict[str, dict[str, str]]:
        return {
            "env_vars": {
                "DPTUNE_CONTROL_URL": self.control_url,
                "DPTUNE_JOB_TOKEN": submission.token,
                "DPTUNE_DATA_DIR": str(self.data_dir.resolve()),
                "DPTUNE_REUSE_PROCESSES": "1" if self.reuse_processes else "0",
                "PYTHONUNBUFFERED": "1",
            }
        }

    def submission_id(self, job_id: int) -> str:
        return f"dptune-{self.namespace}-job-{job_id}"

    def check(self) -> None:
        reason = probe(self.connection)
        if reason is None:
            return
        if self.local_head is None:
            raise OrchestratorUnavailable(reason)
        self.local_head.start(self.connection)

    def submit(self, submission: Submission) -> None:
        """Submit under the job's own submission id, so that Ray itself refuses a second
        submission of one job: that refusal ("already exists") means it has the job. Ray
        answers 500 to a submission its job agent could not take (not up yet after a restart:
        "please try again later"), so only a 4xx refuses the job (:class:`SubmissionRefused`);
        a 5xx leaves it queued for the next try.

        A job whose trials no live node can run is refused too (with ``check_resources``): it
        was admitted while the cluster did not answer, so admission could not check it
        (:mod:`service.admission`); submitted, it would wait for ever holding its reservation.
        """
        if self.check_resources and submission.resources:
            problem = misfit(submission.resources, self.nodes())
            if problem is not None:
                raise SubmissionRefused(str(problem))

        def submit_job() -> None:
            try:
                self.client.submit_job(
                    entrypoint=f"{sys.executable} -m runner {submission.job_id}",
                    submission_id=self.submission_id(submission.job_id),
                    metadata={
                        # the "Name" column of the dashboard's Jobs page
                        "job_name": submission.title or f"dptune job {submission.job_id}",
                        "dptune_job": str(submission.job_id),
                        "dataset": submission.dataset_name,
                    },
                    runtime_env=self.runtime_env(submission),
                )
            except RuntimeError as error:
                if "already exists" in str(error):
                    log.info("job %d: Ray already has it", submission.job_id)
                    return
                code = _http_status(error)
                if code is not None and 400 <= code < 500:
                    raise SubmissionRefused(f"the Ray Jobs API answered HTTP {code}") from None
                raise

        _jobs_api(submit_job)

    def status(self, job_id: int) -> JobState:
        try:
            return _STATES[
                _jobs_api(lambda: self.client.get_job_status(self.submission_id(job_id)))
            ]
        except _NoSuchJob:
            return JobState.LOST

    def cancel(self, job_id: int) -> None:
        with contextlib.suppress(_NoSuchJob):  # nothing left to stop
            _jobs_api(lambda: self.client.stop_job(self.submission_id(job_id)))

    @property
    def dashboard_url(self) -> str:
        return self.connection.dashboard_url

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        states = {}
        for job_id in job_ids:
            try:
                states[job_id] = self.status(job_id)
            except OrchestratorUnavailable:
                continue
        return states

    def logs(self, job_id: int) -> str:
        try:
            return _jobs_api(lambda: self.client.get_job_logs(self.submission_id(job_id)))
        except _NoSuchJob:
            return ""

    def message(self, job_id: int) -> str | None:
        """Ray's message for the job (e.g. that it waits for resources, or how its entrypoint
        failed, quoting the end of its log)."""
        try:
            info = _jobs_api(lambda: self.client.get_job_info(self.submission_id(job_id)))
        except _NoSuchJob:
            return None
        return info.message or None

    def nodes(self) -> list[Node]:
        """The live nodes and their total resources, from Ray's State API (``GET
        /api/v0/nodes``, what ``ray list nodes`` reads), on the dashboard the Jobs API is on."""
        try:
            response = httpx.get(
                f"{self.connection.dashboard_url}/api/v0/nodes",
                params={"limit": 10_000},
                headers=self.connection.headers,
                timeout=5,
            )
        except httpx.HTTPError as error:
            raise OrchestratorUnavailable(
                f"no answer from the Ray State API ({type(error).__name__})"
            ) from None
        if response.status_code != 200:
            raise OrchestratorUnavailable(f"the Ray State API answered HTTP {response.status_code}")
        try:
            listed = response.json()["data"]["result"]["result"]
            return [_node(n) for n in listed if n.get("state") == "ALIVE"]
        except (ValueError, LookupError, TypeError, AttributeError):
            raise OrchestratorUnavailable("the Ray State API answered an unknown form") from None


def _node(node: dict[str, Any]) -> Node:
    total = node.get("resources_total") or {}
    return Node(cpu=float(total.get("CPU", 0)), gpu=float(total.get("GPU", 0)))


def namespace(database_url: str) -> str:
    """A short name for the control plane's database, so that job ids of two control planes
    sharing a cluster do not collide (the URL itself, password included, stays here)."""
    return hashlib.sha256(database_url.encode()).hexdigest()[:8]


def ray_orchestrator(settings: Settings, control_url: str) -> RayOrchestrator:
    """The orchestrator of the configured Ray cluster, or of the local head the state dir owns
    (started by :meth:`RayOrchestrator.check` when it does not answer); jobs' runners will
    report to ``control_url``. Nothing is contacted here: the service starts, degraded, while
    Ray is down. A local head outlives the service on purpose: running jobs carry on across a
    restart and are reconciled when it comes back (``dptune ray stop`` ends it)."""
    address = settings.ray_address
    if address is not None and not address.startswith(("http://", "https://")):
        raise StartupError(
            "dptune: DPTUNE_RAY_ADDRESS must be the URL of the Ray dashboard (Jobs API), "
            "e.g. http://ray-head:8265"
        )
    settings.prepare_dirs()
    local_head = (
        None
        if address
        else LocalHead(
            settings.state_path,
            settings.ray_dashboard_port,
            settings.ray_num_cpus,
            settings.ray_num_gpus,
            cwd=settings.data_path,
        )
    )
    return RayOrchestrator(
        local_head.connection if local_head else connection_to(settings.state_path, address),
        settings.control_url or control_url,
        settings.data_path,
        namespace(settings.sqlalchemy_url),
        local_head,
        settings.reuse_trial_processes,
        settings.ray_check_resources,
    )
