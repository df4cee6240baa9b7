"""Service settings, read from the environment with the ``DPTUNE_`` prefix.

Add a setting by adding a field: ``foo: int = 3`` is read from ``DPTUNE_FOO``.
"""

from __future__ import annotations

import logging
import shutil
from functools import cached_property
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

log = logging.getLogger(__name__)

DATABASE_FILE = "dptune.db"
"""The embedded SQLite database, in the state dir."""
RAY_TOKEN_FILE = "ray-auth-token"
"""The local Ray head's token, in the state dir (when neither ``RAY_AUTH_TOKEN`` nor
``RAY_AUTH_TOKEN_PATH`` names one)."""
LEGACY_TOKEN = Path("ray", "auth_token")
"""Where versions before the state dir kept the Ray token, under the data dir."""


class StartupError(RuntimeError):
    """A start-up failure the operator fixes with a setting or a command. Its message is one
    line that names the setting (``DPTUNE_…``) or the command to run; ``dptune serve`` prints
    it and exits without a traceback."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPTUNE_", env_ignore_empty=True, extra="ignore")

    data_dir: Path = Path(".dptune")
    """Shared with every Ray job: dataset files (the operator's, and uploads under
    ``uploads/``), trials' weights, Tune's results, released models. Nothing of the control
    plane's own state (invariant 16)."""
    state_dir: Path | None = None
    """The control plane's own files, which no Ray job is ever told about (invariant 16): the
    SQLite database and the local Ray head's token; mode 0700, its files 0600. Default: beside
    the data dir, ``<data_dir>-state`` (``./.dptune-state``). It may neither lie inside the data
    dir nor hold it."""
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<state_dir>/dptune.db``. PostgreSQL:
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
    max_dataset_bytes: int = Field(2 * 1024**3, gt=0)
    """The most data a dataset file registered or uploaded may declare (its arrays or table,
    uncompressed): the service reads the file whole, in memory, and refuses a larger one, or
    one declaring over 100 times its size (a decompression bomb), before inflating it."""
    control_url: str | None = None
    """Where a job's runner (on the Ray cluster) reaches this service's internal API. Default:
    the address ``dptune serve`` listens on (``http://127.0.0.1:8000``); set it when Ray nodes
    reach the service by another name (``http://dptune-api:8000``)."""
    ray_address: str | None = None
    """Dashboard/Jobs API URL of a Ray cluster (``http://head:8265``). Unset: ``dptune serve``
    uses the local head the state dir owns, starting it if it does not answer."""
    ray_dashboard_port: int | None = Field(None, gt=0, lt=65536)
    """Dashboard port of the local head. Unset: a free port chosen at its first start and
    recorded in the state dir (``ray-head.json``), as are its other ports and temp dir."""
    ray_num_cpus: int | None = Field(None, gt=0)
    """CPUs of a local head started by dptune (default: all)."""
    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs of a local head started by dptune (default: all that Ray detects)."""
    model_imports: list[Annotated[str, Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")]] = []
    """Modules (exactly these: not their submodules) whose factories jobs may name by import path,
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
    ray_check_resources: bool = True
    """Refuse a job (422 at admission, or failed unrun when it is handed over) whose trials ask
    more CPUs or GPUs than any live Ray node has. Turn off for an autoscaling cluster, whose
    larger nodes may not be up yet."""
    max_json_depth: int = Field(64, gt=0)
    """Request bodies whose arrays and objects nest deeper are refused (422) before they are
    parsed."""
    max_connections: int = Field(1000, gt=0)
    """Open HTTP connections the server keeps; a new one past it closes the one that has been
    quiet longest (idle, or slow to send its request). Keep it below the open-file limit,
    which ``dptune serve`` raises to its hard limit."""
    header_timeout_s: float = Field(10.0, gt=0)
    """How long a connection may take to send a whole request head; then it is closed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """How long a request's body may go without a byte arriving; then it is closed."""
    keep_alive_s: float = Field(5.0, gt=0)
    """How long an idle connection is kept open for its next request."""
    planning_workers: int = Field(2, gt=0)
    """Planning requests (``POST /v1/plans``, ``POST /v1/jobs``) served at once; the others
    wait in a queue (``service.api.shedding``)."""
    planning_per_key: int = Field(1, gt=0)
    """Of those, how many one API key's requests may be."""
    planning_queue: int = Field(64, ge=0)
    """Planning requests that may wait; past it they are refused with 429 (a key holding its
    share of the queue) or 503."""
    retry_after_s: int = Field(1, gt=0)
    """``Retry-After`` of those refusals, in seconds."""

    @cached_property
    def data_path(self) -> Path:
        """``data_dir`` made absolute, so that containment checks compare like with like."""
        return self.data_dir.expanduser().resolve()

    @cached_property
    def state_path(self) -> Path:
        """``state_dir`` made absolute; by default derived from the data dir, so that two data
        dirs (two services, two tests) never share a database."""
        if self.state_dir is not None:
            return self.state_dir.expanduser().resolve()
        return (self.data_path.parent / f"{self.data_path.name}-state").resolve()

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.state_path / DATABASE_FILE}"

    def prepare_dirs(self) -> None:
        """Check and create the data and state dirs before the database is opened or Ray is
        contacted (:class:`StartupError` names the setting to change). A database or Ray token
        that an older version kept in the data dir, which every Ray job receives, is moved into
        the state dir first (invariant 16)."""
        self._check_apart()
        self.data_path.mkdir(parents=True, exist_ok=True)
        self._adopt_legacy_files()
        if self.database_url is None:
            private_file(private_dir(self.state_path) / DATABASE_FILE)

    def _check_apart(self) -> None:
        data, state = self.data_path, self.state_path
        if state.is_relative_to(data) or data.is_relative_to(state):
            raise StartupError(
                f"dptune: DPTUNE_STATE_DIR ({state}) and DPTUNE_DATA_DIR ({data}) must not "
                "contain each other: every Ray job can read and write the data dir"
            )
        database = sqlite_file(self.database_url)
        if database is not None and database.is_relative_to(data):
            raise StartupError(
                f"dptune: DPTUNE_DATABASE_URL names a SQLite file inside DPTUNE_DATA_DIR ({data}),"
                " which every Ray job can read and write: leave it unset (the database then "
                "lives in DPTUNE_STATE_DIR)"
            )

    def _adopt_legacy_files(self) -> None:
        """The database moves (with its WAL files); the token is copied, since a Ray head
        started by the older version still reads it where it was."""
        old_db, new_db = self.data_path / DATABASE_FILE, self.state_path / DATABASE_FILE
        if old_db.exists():
            if new_db.exists() and new_db.stat().st_size > 0:
                raise StartupError(
                    f"dptune: there is a database at {old_db} (an older version's, in "
                    f"DPTUNE_DATA_DIR) and one at {new_db} (DPTUNE_STATE_DIR): move away the one "
                    "not to keep"
                )
            private_dir(self.state_path)
            for suffix in ("", "-wal", "-shm"):
                if (old := old_db.with_name(old_db.name + suffix)).exists():
                    private_file(Path(shutil.move(old, new_db.with_name(new_db.name + suffix))))
            log.warning(
                "moved the database from %s to %s (DPTUNE_STATE_DIR); Ray jobs it submitted "
                "before are not found under the new database's name: those still running are "
                "failed and charged their reservation",
                old_db,
                new_db,
            )
        old_token, new_token = self.data_path / LEGACY_TOKEN, self.state_path / RAY_TOKEN_FILE
        if old_token.exists() and not new_token.exists():
            private_dir(self.state_path)
            private_file(Path(shutil.copyfile(old_token, new_token)))
            log.warning(
                "copied the Ray token from %s to %s (DPTUNE_STATE_DIR): delete the old file once "
                "the Ray head started with it has stopped",
                old_token,
                new_token,
            )


def sqlite_file(url: str | None) -> Path | None:
    """The file of a SQLite URL, absolute; None for any other URL (a malformed one is
    :func:`service.db.create_db_engine`'s to refuse)."""
    try:
        parsed = make_url(url) if url else None
    except (ArgumentError, ValueError):
        return None
    if parsed is None or parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return None if parsed.database == ":memory:" else Path(parsed.database).expanduser().resolve()


def private_dir(path: Path) -> Path:
    """``path``, created if missing, readable by its owner alone (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """``path``, created empty if missing, readable by its owner alone (0600). SQLite gives the
    WAL files it creates beside a database the database file's mode."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    return path
