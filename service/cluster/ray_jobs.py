"""Each admitted tuning job runs as one Ray job whose entrypoint is the runner's driver
``python -m runner <id>`` (Ray Tune inside); the dashboard's Jobs view shows it, with its
logs, under the submission id ``dptune-<db>-job-<id>`` (``<db>`` tells apart the databases
that share a cluster: job ids are only unique within one)."""

from __future__ import annotations

import contextlib
import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

from service.cluster.head import RayConnection, connect
from service.orchestration import JobState, Submission
from service.settings import Settings

_STATES = {
    JobStatus.PENDING: JobState.QUEUED,
    JobStatus.RUNNING: JobState.RUNNING,
    JobStatus.STOPPED: JobState.CANCELLED,
    JobStatus.SUCCEEDED: JobState.SUCCEEDED,
    JobStatus.FAILED: JobState.FAILED,
}


@dataclass
class RayOrchestrator:
    """Runs jobs on the cluster behind ``connection``. A job's runner reports to the control
    plane at ``control_url`` with the job's token; it holds no database credentials.

    A Ray job's runtime environment is visible to anyone who can open the Ray dashboard, so it
    carries an explicit allow-list (:meth:`runtime_env`): where the control plane is, the job's
    token (good for recording that job's own trials only, never for reducing a charge), the
    data directory — never the operator key, the database URL or any other ``DPTUNE_*``
    setting of the service. ``namespace`` tells apart the control planes (databases) that
    share a cluster."""

    connection: RayConnection
    control_url: str
    data_dir: Path
    namespace: str
    client: JobSubmissionClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = JobSubmissionClient(
            self.connection.dashboard_url, headers=self.connection.headers
        )

    def runtime_env(self, submission: Submission) -> dict[str, dict[str, str]]:
        return {
            "env_vars": {
                "DPTUNE_CONTROL_URL": self.control_url,
                "DPTUNE_JOB_TOKEN": submission.token,
                "DPTUNE_DATA_DIR": str(self.data_dir.resolve()),
                "PYTHONUNBUFFERED": "1",
            }
        }

    def submission_id(self, job_id: int) -> str:
        return f"dptune-{self.namespace}-job-{job_id}"

    def submit(self, submission: Submission) -> None:
        self.client.submit_job(
            entrypoint=f"{sys.executable} -m runner {submission.job_id}",
            submission_id=self.submission_id(submission.job_id),
            metadata={"dptune_job": str(submission.job_id), "dataset": submission.dataset_name},
            runtime_env=self.runtime_env(submission),
        )

    def status(self, job_id: int) -> JobState:
        try:
            return _STATES[self.client.get_job_status(self.submission_id(job_id))]
        except RuntimeError:  # the Jobs API answers 404 for a job it does not know: lost
            return JobState.LOST

    def cancel(self, job_id: int) -> None:
        with contextlib.suppress(RuntimeError):  # already gone: nothing left to stop
            self.client.stop_job(self.submission_id(job_id))

    @property
    def dashboard_url(self) -> str:
        return self.connection.dashboard_url

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {job_id: self.status(job_id) for job_id in job_ids}

    def logs(self, job_id: int) -> str:
        return self.client.get_job_logs(self.submission_id(job_id))


def namespace(database_url: str) -> str:
    """A short name for the control plane's database, so that job ids of two control planes
    sharing a cluster do not collide (the URL itself, password included, stays here)."""
    return hashlib.sha256(database_url.encode()).hexdigest()[:8]


def ray_orchestrator(settings: Settings, control_url: str) -> RayOrchestrator:
    """Connect to the configured Ray cluster, or the local head (started if none answers);
    jobs' runners will report to ``control_url``. A local head outlives the service on
    purpose: running jobs carry on across a restart and are reconciled when it comes back
    (``ray stop`` ends it)."""
    settings.data_path.mkdir(parents=True, exist_ok=True)
    connection = connect(
        settings.data_path,
        settings.ray_address,
        settings.ray_dashboard_port,
        settings.ray_num_cpus,
        settings.ray_num_gpus,
    )
    return RayOrchestrator(
        connection,
        settings.control_url or control_url,
        settings.data_path,
        namespace(settings.sqlalchemy_url),
    )
