"""Each admitted tuning job runs as one Ray job whose entrypoint is the driver
``python -m workers.job <id>`` (Ray Tune inside); the dashboard's Jobs view shows it, with its
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
from service.orchestrator import JobState, Submission
from service.settings import Settings

_STATES = {
    JobStatus.PENDING: JobState.QUEUED,
    JobStatus.RUNNING: JobState.RUNNING,
    JobStatus.STOPPED: JobState.CANCELLED,
    JobStatus.SUCCEEDED: JobState.SUCCEEDED,
    JobStatus.FAILED: JobState.FAILED,
}



def write_secret(path: Path, value: str) -> Path:
    """Write ``value`` to ``path`` readable by its owner only (created with mode 0600, never
    world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(value)
    return path


@dataclass
class RayOrchestrator:
    """Runs jobs on the cluster behind ``connection``. The driver reads the job from the same
    database (``database_url``) and writes trials, charges and the released model to it.

    A Ray job's runtime environment is visible to anyone who can open the Ray dashboard, so it
    carries an explicit allow-list (:meth:`runtime_env`): the data directory, the *path* of a
    0600 file under it holding the database URL, and nothing else — never the operator key or
    any other ``DPTUNE_*`` setting of the service."""

    connection: RayConnection
    database_url: str
    data_dir: Path
    client: JobSubmissionClient = field(init=False)
    database_url_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.client = JobSubmissionClient(self.connection.dashboard_url,
                                          headers=self.connection.headers)
        self.database_url_file = write_secret(
            self.data_dir.resolve() / "secrets" / "database_url", self.database_url)

    def runtime_env(self) -> dict[str, dict[str, str]]:
        return {"env_vars": {
            "DPTUNE_DATA_DIR": str(self.data_dir.resolve()),
            "DPTUNE_DATABASE_URL_FILE": str(self.database_url_file),
            "PYTHONUNBUFFERED": "1",
        }}

    def submission_id(self, job_id: int) -> str:
        database = hashlib.sha256(self.database_url.encode()).hexdigest()[:8]
        return f"dptune-{database}-job-{job_id}"

    def submit(self, submission: Submission) -> None:
        self.client.submit_job(
            entrypoint=f"{sys.executable} -m workers.job {submission.job_id}",
            submission_id=self.submission_id(submission.job_id),
            metadata={"dptune_job": str(submission.job_id),
                      "dataset": submission.dataset_source},
            runtime_env=self.runtime_env(),
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


def ray_orchestrator(settings: Settings) -> RayOrchestrator:
    """Connect to the configured Ray cluster, or the local head (started if none answers).
    A local head outlives the service on purpose: running jobs carry on across a restart and
    are reconciled when it comes back (``ray stop`` ends it)."""
    settings.data_path.mkdir(parents=True, exist_ok=True)
    connection = connect(settings.data_path, settings.ray_address, settings.ray_dashboard_port,
                         settings.ray_num_cpus, settings.ray_num_gpus)
    return RayOrchestrator(connection, settings.sqlalchemy_url, settings.data_path)
