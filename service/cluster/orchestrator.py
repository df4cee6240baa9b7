"""Each admitted tuning job runs as one Ray job whose entrypoint is the driver
``python -m workers.job <id>`` (Ray Tune inside); the dashboard's Jobs view shows it, with its
logs, under the submission id ``dptune-job-<id>``."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

from service.cluster.head import RayConnection
from service.orchestrator import JobState, Submission

_STATES = {
    JobStatus.PENDING: JobState.QUEUED,
    JobStatus.RUNNING: JobState.RUNNING,
    JobStatus.STOPPED: JobState.CANCELLED,
    JobStatus.SUCCEEDED: JobState.SUCCEEDED,
    JobStatus.FAILED: JobState.FAILED,
}


def submission_id(job_id: int) -> str:
    return f"dptune-job-{job_id}"


@dataclass
class RayOrchestrator:
    """Runs jobs on the cluster behind ``connection``. The driver reads the job from the same
    database (``database_url``) and writes trials, charges and the released model to it."""

    connection: RayConnection
    database_url: str
    data_dir: Path
    client: JobSubmissionClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = JobSubmissionClient(self.connection.dashboard_url,
                                          headers=self.connection.headers)

    def submit(self, submission: Submission) -> None:
        self.client.submit_job(
            entrypoint=f"{sys.executable} -m workers.job {submission.job_id}",
            submission_id=submission_id(submission.job_id),
            metadata={"dptune_job": str(submission.job_id),
                      "dataset": submission.dataset_source},
            runtime_env={"env_vars": {
                "DPTUNE_DATABASE_URL": self.database_url,
                "DPTUNE_DATA_DIR": str(self.data_dir.resolve()),
                "PYTHONUNBUFFERED": "1",
            }},
        )

    def status(self, job_id: int) -> JobState:
        try:
            return _STATES[self.client.get_job_status(submission_id(job_id))]
        except RuntimeError:  # the Jobs API answers 404 for a job it does not know: lost
            return JobState.FAILED

    def cancel(self, job_id: int) -> None:
        with contextlib.suppress(RuntimeError):  # already gone: nothing left to stop
            self.client.stop_job(submission_id(job_id))

    def reconcile(self, job_ids: list[int]) -> dict[int, JobState]:
        return {job_id: self.status(job_id) for job_id in job_ids}

    def logs(self, job_id: int) -> str:
        return self.client.get_job_logs(submission_id(job_id))
