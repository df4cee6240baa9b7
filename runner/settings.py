"""What a runner is started with: its Ray job's environment, an explicit allow-list
(``service.cluster.ray_jobs.RayOrchestrator.runtime_env``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class RunnerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPTUNE_", extra="ignore")

    control_url: str
    """The control plane's base URL (its internal API is under ``/internal/v1``)."""
    job_token: SecretStr
    """The job-scoped token minted when the job was submitted."""
    data_dir: Path
    """Shared storage: operator-provided datasets, and trials' weights until one is released."""
    reuse_processes: bool = True
    """Whether trials reuse worker processes (the service's ``reuse_trial_processes``)."""
