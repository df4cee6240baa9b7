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
    operator_key: SecretStr | None = Field(None, min_length=16)
    """Bootstrap operator key. Unset: the first start creates one and prints it once."""
    max_body_bytes: int = Field(64 * 1024, gt=0)
    """Requests with a larger body are refused (413) before they are parsed."""

    @cached_property
    def data_path(self) -> Path:
        """``data_dir`` made absolute, so that containment checks compare like with like."""
        return self.data_dir.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_path / 'dptune.db'}"
