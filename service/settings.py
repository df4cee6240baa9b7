"""Service settings, read from the environment with the ``DPTUNE_`` prefix.

Add a setting by adding a field: ``foo: int = 3`` is read from ``DPTUNE_FOO``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPTUNE_", env_ignore_empty=True, extra="ignore")

    data_dir: Path = Path(".dptune")
    """Holds the SQLite file, released models and operator-provided ``.npz`` datasets."""
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<data_dir>/dptune.db``. PostgreSQL:
    ``postgresql+psycopg://user:pass@host/db`` (``pip install 'dptune[postgres]'``)."""
    database_url_file: Path | None = None
    """A file holding the SQLAlchemy URL, read when ``database_url`` is unset. Ray jobs get the
    URL this way: a Ray job's environment is shown in the Ray dashboard, a password must not."""
    operator_key: SecretStr | None = Field(None, min_length=16)
    """Bootstrap operator key. Unset: the first start creates one and prints it once."""
    max_body_bytes: int = Field(64 * 1024, gt=0)
    """Requests with a larger body are refused (413) before they are parsed."""
    ray_address: str | None = None
    """Dashboard/Jobs API URL of a Ray cluster (``http://head:8265``). Unset: ``dptune serve``
    uses the local head on ``ray_dashboard_port``, starting one if none answers."""
    ray_dashboard_port: int = Field(8265, gt=0, lt=65536)
    ray_num_cpus: int | None = Field(None, gt=0)
    """CPUs of a local head started by dptune (default: all)."""
    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs of a local head started by dptune (default: all that Ray detects)."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often the service asks the orchestrator about running jobs, so that jobs that end
    are settled even if nobody asks about them."""

    @cached_property
    def data_path(self) -> Path:
        """``data_dir`` made absolute, so that containment checks compare like with like."""
        return self.data_dir.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        if self.database_url_file is not None:
            return self.database_url_file.read_text().strip()
        return f"sqlite:///{self.data_path / 'dptune.db'}"
