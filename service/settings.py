"""Service settings, read from the environment with the ``DPTUNE_`` prefix.

Add a setting by adding a field: ``foo: int = 3`` is read from ``DPTUNE_FOO``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class StartupError(RuntimeError):
    """A start-up failure the operator fixes with a setting or a command. Its message is one
    line that names the setting (``DPTUNE_…``) or the command to run; ``dptune serve`` prints
    it and exits without a traceback."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPTUNE_", env_ignore_empty=True, extra="ignore")

    data_dir: Path = Path(".dptune")
    """Holds the SQLite file, released models and dataset files (the operator's, and uploads
    under ``uploads/``)."""
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<data_dir>/dptune.db``. PostgreSQL:
    ``postgresql+psycopg://user:pass@host/db`` (``pip install 'dptune[postgres]'``)."""
    auto_upgrade: bool = False
    """Migrate a database at an older schema revision at start. Off: the service refuses to
    start on one and names the command (``dptune db upgrade``); an empty database is always
    created."""
    operator_key: SecretStr | None = Field(None, min_length=16)
    """Bootstrap operator key. Unset: the first start creates one and prints it once."""
    max_body_bytes: int = Field(64 * 1024, gt=0)
    """Requests with a larger body are refused (413) before they are parsed."""
    max_model_bytes: int = Field(2 * 1024**3, gt=0)
    """The largest model a job's runner may upload (the released weights)."""
    max_upload_bytes: int = Field(1024**3, gt=0)
    """The largest dataset file an operator may upload (``PUT /v1/datasets/{id}/data``)."""
    control_url: str | None = None
    """Where a job's runner (on the Ray cluster) reaches this service's internal API. Default:
    the address ``dptune serve`` listens on (``http://127.0.0.1:8000``); set it when Ray nodes
    reach the service by another name (``http://dptune-api:8000``)."""
    ray_address: str | None = None
    """Dashboard/Jobs API URL of a Ray cluster (``http://head:8265``). Unset: ``dptune serve``
    uses the local head on ``ray_dashboard_port``, starting one if none answers."""
    ray_dashboard_port: int = Field(8265, gt=0, lt=65536)
    ray_num_cpus: int | None = Field(None, gt=0)
    """CPUs of a local head started by dptune (default: all)."""
    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs of a local head started by dptune (default: all that Ray detects)."""
    model_imports: list[Annotated[str, Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")]] = []
    """Modules (each with its submodules) whose model factories jobs may name by import path,
    ``"model": {"name": "package.module:factory"}``; a JSON list in the environment:
    ``DPTUNE_MODEL_IMPORTS='["mypkg.models"]'``. The package must be installed where the service
    runs (it inspects the model at admission) and on the Ray nodes. Empty: built-in models only,
    so that no caller runs code of their choosing on the cluster; operators' jobs included."""
    reuse_trial_processes: bool = True
    """Run a job's trials one after another in the same Ray worker processes (Ray Tune's actor
    reuse), which import torch and read the dataset once; each trial still builds its own
    model and draws its own randomness. Off: a fresh process per trial (seconds of start-up
    each), e.g. for an own model package that keeps state between the models it builds."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often the service asks the orchestrator about running jobs, so that jobs that end
    are settled even if nobody asks about them."""
    ray_give_up_s: float = Field(1800.0, gt=0)
    """How long the Ray Jobs API may go unanswered before the jobs running there are failed
    (charged the attempts they recorded, the rest of their reservations released). Jobs not
    handed to Ray yet stay queued however long it takes."""

    @cached_property
    def data_path(self) -> Path:
        """``data_dir`` made absolute, so that containment checks compare like with like."""
        return self.data_dir.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_path / 'dptune.db'}"
