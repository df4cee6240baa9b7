"""Connecting to Ray: an existing cluster (``DPTUNE_RAY_ADDRESS``) or the local head that a
state dir owns.

``dptune serve`` does not wait for Ray: it starts with its cluster down and keeps trying in the
background (:class:`LocalHead`, :func:`probe`), so budgets and jobs can be read meanwhile.

**The local head is the state dir's own.** Its temp dir (``/tmp/dptune-ray-<random>``: short,
since Ray's Unix socket paths must stay under 108 bytes) and every port it listens on are
chosen free once and recorded in ``<state dir>/ray-head.json`` (:class:`HeadRecord`), so two
data dirs give two heads side by side and neither attaches to, nor clobbers, another Ray
cluster on the machine (``ray start`` gets the temp dir, the ports, and no ``RAY_ADDRESS``).
It is stopped by its own process ids (:func:`head_processes`), never ``ray stop``, which ends
every Ray cluster of the user. The temp dir is outside the state dir: every Ray process is
told it, and none may learn where the state dir is (invariant 16).

Ray 2.60 turns token authentication on for new local clusters. We keep it on: the token lives
in ``<state dir>/ray-auth-token`` (created once, mode 0600) unless ``RAY_AUTH_TOKEN`` /
``RAY_AUTH_TOKEN_PATH`` name one, the local head is started with it, and every Jobs API call
sends it as ``Authorization: Bearer``. Only the test suite sets ``RAY_AUTH_MODE=disabled``.
Every Ray process, trials included, holds the token (Ray's workers authenticate with it); none
is told where the state dir is (invariant 16).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import psutil
from pydantic import BaseModel

from service.orchestration import OrchestratorUnavailable
from service.settings import RAY_TOKEN_FILE, private_dir, private_file

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
HEAD_FILE = "ray-head.json"
"""The local head's temp dir and ports, in the state dir."""
LEGACY_DASHBOARD_PORT = 8265
"""Where the head that versions before the record started listens (Ray's default ports, its
default temp dir), with the state dir's token."""
WORKER_PORTS = 200
"""Ports for the head's workers (one each), below the ephemeral range (32768 on) in which the
other ports are chosen."""
_WORKER_RANGE = range(20000, 32768 - WORKER_PORTS, WORKER_PORTS)


class HeadError(RuntimeError):
    """The local head cannot start; the message is one line saying why and what to set."""


class HeadRecord(BaseModel, frozen=True):
    """Where the local head of one state dir lives: its temp dir and its ports, each field
    named after the ``ray start`` flag that sets it (``gcs_port`` is ``--port``)."""

    temp_dir: Path
    gcs_port: int
    dashboard_port: int
    ray_client_server_port: int
    node_manager_port: int
    object_manager_port: int
    metrics_export_port: int
    dashboard_agent_listen_port: int
    dashboard_agent_grpc_port: int
    runtime_env_agent_port: int
    min_worker_port: int
    max_worker_port: int

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"{HOST}:{self.gcs_port}"

    def listening_ports(self) -> dict[str, int]:
        """The ports the head listens on itself (its workers' range aside), by field name."""
        return {
            name: value
            for name, value in self.model_dump().items()
            if name.endswith("_port") and "worker" not in name
        }

    def flags(self) -> list[str]:
        """``ray start``'s: this temp dir and these ports, on the loopback interface."""
        flags = [f"--temp-dir={self.temp_dir}", f"--node-ip-address={HOST}"]
        for name, value in self.model_dump().items():
            if name.endswith("_port"):
                flag = "port" if name == "gcs_port" else name.replace("_", "-")
                flags.append(f"--{flag}={value}")
        return flags


@dataclass(frozen=True)
class RayConnection:
    """Where the Jobs API is and how to authenticate to it; ``record`` is the local head's,
    when it is one."""

    dashboard_url: str
    token: str | None
    started_here: bool
    record: HeadRecord | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def stop(self) -> None:
        """Stop the local head if this process started it (by its process ids)."""
        if self.started_here and self.record is not None:
            stop_head(self.record)


def _ray_cli() -> str:
    found = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if found is None:
        raise HeadError(
            "Ray is not installed where dptune runs (no `ray` command): install dptune with its "
            "dependencies, or set DPTUNE_RAY_ADDRESS to the dashboard URL of a Ray cluster"
        )
    return found


def auth_enabled() -> bool:
    return os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled"


def ensure_token(state_dir: Path) -> str:
    """The Ray token: ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``, or one created
    once in the state dir. Exported as ``RAY_AUTH_TOKEN`` so that Ray (and the processes it
    starts: a local head, its trials) use it by value, never learning the state dir's path."""
    if token := os.environ.get("RAY_AUTH_TOKEN"):
        return token
    configured = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(configured) if configured else private_dir(state_dir) / RAY_TOKEN_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        private_file(path).write_text(secrets.token_hex(32))
    token = path.read_text().strip()
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    return token


def probe(connection: RayConnection, timeout_s: float = 5) -> str | None:
    """None when the Jobs API at ``connection`` answers (token included), else why not, in one
    line that names no address: it is shown on the unauthenticated ``/healthz``."""
    try:
        url = f"{connection.dashboard_url}/api/version"
        response = httpx.get(url, headers=connection.headers, timeout=timeout_s)
    except httpx.HTTPError as error:
        return f"no answer from the Ray Jobs API ({type(error).__name__})"
    if response.status_code in (401, 403):
        return "the Ray Jobs API refused the Ray auth token"
    if response.status_code != 200:
        return f"the Ray Jobs API answered HTTP {response.status_code}"
    return None


# --- ports and the record ----------------------------------------------------------------------


def port_taken(port: int) -> bool:
    """Whether something listens on ``port`` (on any interface); a port left in TIME_WAIT by a
    head that stopped is free (``SO_REUSEADDR``, as Ray's servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct free ports, none of ``avoid``, held open together while they are
    chosen. ``avoid``: ports chosen but not listened on yet (the kernel may hand them out)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count + len(avoid))]
        for s in sockets:
            s.bind(("", 0))
        ports = [int(s.getsockname()[1]) for s in sockets]
    return [port for port in ports if port not in avoid][:count]


def _free_worker_range(avoid: Collection[int] = ()) -> int:
    """The first port of ``WORKER_PORTS`` free ones, none of ``avoid``, at random among the
    candidate ranges."""
    starts = list(_WORKER_RANGE)
    for start in secrets.SystemRandom().sample(starts, len(starts)):
        span = range(start, start + WORKER_PORTS)
        if not any(p in avoid or port_taken(p) for p in span):
            return start
    raise HeadError(
        f"no {WORKER_PORTS} free ports in {_WORKER_RANGE.start}-{_WORKER_RANGE.stop} for the "
        "local Ray head's workers: set DPTUNE_RAY_ADDRESS to a Ray cluster's dashboard URL"
    )


def choose_record(dashboard_port: int | None = None) -> HeadRecord:
    """A new temp dir name and free ports (``dashboard_port`` if given) for a local head."""
    listening = [n for n in HeadRecord.model_fields if n.endswith("_port") and "worker" not in n]
    ports = {} if dashboard_port is None else {"dashboard_port": dashboard_port}
    drawn = [name for name in listening if name not in ports]
    ports |= dict(zip(drawn, free_ports(len(drawn), avoid=ports.values()), strict=True))
    low = _free_worker_range(avoid=ports.values())
    return HeadRecord(
        temp_dir=Path("/tmp") / f"dptune-ray-{secrets.token_hex(4)}",
        min_worker_port=low,
        max_worker_port=low + WORKER_PORTS - 1,
        **ports,
    )


def load_record(state_dir: Path) -> HeadRecord | None:
    path = state_dir / HEAD_FILE
    return HeadRecord.model_validate_json(path.read_text()) if path.exists() else None


def save_record(state_dir: Path, record: HeadRecord) -> None:
    """Write the record whole (a reader never sees half of it), mode 0600."""
    part = private_file(private_dir(state_dir) / f"{HEAD_FILE}.part")
    part.write_text(record.model_dump_json(indent=1))
    part.replace(state_dir / HEAD_FILE)


def own_record(state_dir: Path, dashboard_port: int | None = None) -> HeadRecord:
    """The record of the state dir's head, chosen and saved on first use. A pinned
    ``dashboard_port`` (``DPTUNE_RAY_DASHBOARD_PORT``) replaces the recorded one unless the
    head runs."""
    record = load_record(state_dir)
    if record is None:
        record = choose_record(dashboard_port)
    elif dashboard_port not in (None, record.dashboard_port) and not head_processes(record):
        record = record.model_copy(update={"dashboard_port": dashboard_port})
    else:
        return record
    save_record(state_dir, record)
    return record


# --- the head's processes -----------------------------------------------------------------------


def _names_temp_dir(cmdline: list[str], temp_dir: str) -> bool:
    return any(arg.endswith(temp_dir) or f"{temp_dir}/" in arg for arg in cmdline)


def _is_client_server(cmdline: list[str], gcs_port: int) -> bool:
    """Whether this is the Ray client server of the head whose GCS is on ``gcs_port`` (its
    address names the node's IP, which Ray may choose over the one it was given)."""
    return "ray.util.client.server" in cmdline and any(
        arg.startswith("--address=") and arg.endswith(f":{gcs_port}") for arg in cmdline
    )


def head_processes(record: HeadRecord) -> list[psutil.Process]:
    """The head's processes: those whose command line names its temp dir (GCS, raylet,
    dashboard, agents), its Ray client server (which names its GCS address instead), and all
    their descendants (the workers, which Ray renames ``ray::…``)."""
    roots: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if _names_temp_dir(cmdline, str(record.temp_dir)) or _is_client_server(
            cmdline, record.gcs_port
        ):
            roots[process.pid] = process
    found = dict(roots)
    for process in roots.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            found.update((child.pid, child) for child in process.children(recursive=True))
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_head(record: HeadRecord, grace_s: float = 3) -> list[int]:
    """Stop the head's processes (SIGTERM, then SIGKILL after ``grace_s``) until none is
    left; the ids of those stopped. Nothing else on the machine is touched."""
    stopped: set[int] = set()
    for _ in range(5):  # a worker started meanwhile is found on the next round
        processes = head_processes(record)
        if not processes:
            break
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=grace_s)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=grace_s)
        stopped |= {p.pid for p in processes}
    return sorted(stopped)


# --- starting it ---------------------------------------------------------------------------------


def _why_port_taken(record: HeadRecord, token: str | None) -> str:
    """What holds the head's dashboard port, and what to set instead, in one line."""
    port = record.dashboard_port
    answer = probe(RayConnection(record.dashboard_url, token, started_here=False), timeout_s=1)
    if answer == "the Ray Jobs API refused the Ray auth token":
        return (
            f"a Ray head that is not this data directory's answers on port {port} and refuses "
            "its Ray token: set DPTUNE_RAY_DASHBOARD_PORT to a free port, or "
            f"DPTUNE_RAY_ADDRESS=http://{HOST}:{port} (and that head's RAY_AUTH_TOKEN) to use it"
        )
    return (
        f"port {port} of the local Ray head's dashboard is taken by another process: "
        "set DPTUNE_RAY_DASHBOARD_PORT to a free port"
    )


def _refuse_to_orphan_a_legacy_head(record: HeadRecord, token: str | None) -> None:
    """Do not start a second head beside one that an older dptune started for this state dir
    (it takes the state dir's token): the service would find no record of the jobs running
    there and fail them, charged their whole reservations."""
    port = LEGACY_DASHBOARD_PORT
    legacy = RayConnection(f"http://{HOST}:{port}", token, started_here=False)
    if token and record.dashboard_port != port and probe(legacy, timeout_s=1) is None:
        raise HeadError(
            f"a Ray head holding this data directory's Ray token answers on {HOST}:{port} "
            "(started by an older dptune?) and its jobs would be lost: set "
            f"DPTUNE_RAY_ADDRESS=http://{HOST}:{port} to keep using it, or stop it first"
        )


def _with_free_ports(record: HeadRecord) -> HeadRecord:
    """``record`` with each port that is taken, or that the record already uses, replaced by a
    free one — all but the dashboard's (which users may have bookmarked, and the service
    already told). No two of a head's components may share a port (``ray start`` refuses),
    yet a pinned dashboard port can be one of those recorded, and a port drawn while another
    was chosen but not listened on can repeat it."""
    listening = record.listening_ports()
    kept = {"dashboard_port": record.dashboard_port}
    for name, port in listening.items():
        if port not in kept.values() and not port_taken(port):
            kept[name] = port
    redraw = [name for name in listening if name not in kept]
    ports = kept | dict(zip(redraw, free_ports(len(redraw), avoid=kept.values()), strict=True))
    span = range(record.min_worker_port, record.max_worker_port + 1)
    if any(p in ports.values() or port_taken(p) for p in span):
        low = _free_worker_range(avoid=ports.values())
        ports |= {"min_worker_port": low, "max_worker_port": low + WORKER_PORTS - 1}
    return record.model_copy(update=ports)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _last_line(output: str) -> str:
    lines = [line.strip() for line in _ANSI.sub("", output).splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no output"


def _start_head(
    record: HeadRecord, num_cpus: int | None, num_gpus: int | None, cwd: Path | None = None
) -> None:
    """``ray start --head`` in the record's temp dir on its ports. Its processes — every job's
    driver, every trial — inherit its environment and its working directory ``cwd`` (the data
    dir, not the service's own, which may hold the state dir)."""
    cmd = [_ray_cli(), "start", "--head", *record.flags(), f"--dashboard-host={HOST}"]
    cmd += ["--disable-usage-stats"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    log.info("starting the local Ray head: %s", " ".join(cmd))
    # Ray's processes (and so every trial) inherit the head's environment: keep the service's
    # own settings — the operator key, the database URL — out of it, and any RAY_ADDRESS,
    # which would make ``ray start`` join that cluster.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_") and k != "RAY_ADDRESS"
    }
    record.temp_dir.mkdir(mode=0o700, exist_ok=True)
    if record.temp_dir.stat().st_uid != os.getuid():
        raise HeadError(
            f"{record.temp_dir}, the local Ray head's temp dir, belongs to another user: delete "
            f"{HEAD_FILE} in DPTUNE_STATE_DIR so that dptune chooses another"
        )
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=cwd
    )
    if done.returncode != 0:
        raise HeadError(f"`ray start` failed: {_last_line(done.stderr or done.stdout)}")


def _wait_until_up(connection: RayConnection, record: HeadRecord, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while probe(connection) is not None:
        if time.monotonic() > deadline:
            raise HeadError(
                f"the local Ray head started but its Jobs API did not answer within "
                f"{timeout_s:.0f} s: see {record.temp_dir}/session_latest/logs"
            )
        time.sleep(0.5)


def connection_to(state_dir: Path, address: str) -> RayConnection:
    """The Jobs API of the cluster at ``address``, with the token to send it
    (:func:`ensure_token`); nothing is contacted."""
    token = ensure_token(state_dir) if auth_enabled() else None
    return RayConnection(address, token, started_here=False)


_COULD_NOT_START = "could not start the local Ray head (the service log says why)"


@dataclass
class LocalHead:
    """The local head that ``state_dir`` owns (the embedded default, no
    ``DPTUNE_RAY_ADDRESS``), started whenever its Jobs API does not answer — at start, and
    again in the background should it fail to start or stop later — at most once per
    ``retry_s``, so that a head that cannot start (a port taken, Ray missing) costs one try,
    and one log line saying why (:attr:`why`), per interval."""

    state_dir: Path
    dashboard_port: int | None = None  # DPTUNE_RAY_DASHBOARD_PORT; None: the recorded one
    num_cpus: int | None = None
    num_gpus: int | None = None
    cwd: Path | None = None  # the data dir: jobs' drivers start there
    retry_s: float = 30.0
    timeout_s: float = 120.0
    started: bool = field(default=False, init=False)
    why: str | None = field(default=None, init=False)
    _next_try: float = field(default=0.0, init=False)

    @property
    def record(self) -> HeadRecord:
        return own_record(self.state_dir, self.dashboard_port)

    @property
    def connection(self) -> RayConnection:
        """The Jobs API of this head, with the token to send it; nothing is contacted."""
        record = self.record
        token = ensure_token(self.state_dir) if auth_enabled() else None
        return RayConnection(record.dashboard_url, token, started_here=False, record=record)

    def launch(self, connection: RayConnection) -> None:
        """Start the head behind ``connection`` and wait for its Jobs API (:class:`HeadError`
        says why it cannot)."""
        record = self.record
        if running := head_processes(record):
            raise HeadError(
                f"the local Ray head of this data directory runs (pids "
                f"{' '.join(str(p.pid) for p in running[:5])}) but its Jobs API does not "
                f"answer: see {record.temp_dir}/session_latest/logs, or end it with "
                "`dptune ray stop`"
            )
        if port_taken(record.dashboard_port):
            raise HeadError(_why_port_taken(record, connection.token))
        _refuse_to_orphan_a_legacy_head(record, connection.token)
        if (fresh := _with_free_ports(record)) != record:
            save_record(self.state_dir, fresh)
        try:
            _start_head(fresh, self.num_cpus, self.num_gpus, self.cwd)
        except HeadError:
            stop_head(fresh)  # what a failed start left behind
            with contextlib.suppress(OSError):  # unless it holds Ray's logs of the failure
                fresh.temp_dir.rmdir()
            raise
        self.started = True
        _wait_until_up(connection, fresh, self.timeout_s)

    def start(self, connection: RayConnection) -> None:
        """:meth:`launch`, at most once per ``retry_s``; raise
        :class:`OrchestratorUnavailable` (why goes to the log, in one line) when it fails."""
        if time.monotonic() < self._next_try:
            raise OrchestratorUnavailable(_COULD_NOT_START)
        self._next_try = time.monotonic() + self.retry_s
        try:
            self.launch(connection)
            self.why = None
        except (HeadError, OSError, subprocess.SubprocessError) as error:
            self.why = " ".join(str(error).split()) or type(error).__name__
            log.warning(
                "could not start the local Ray head (retrying in %.0f s): %s",
                self.retry_s,
                self.why,
            )
            raise OrchestratorUnavailable(_COULD_NOT_START) from None

    def stop(self) -> None:
        """Stop the head if this process started it, by its process ids."""
        if self.started:
            stop_head(self.record)


def connect(
    state_dir: Path,
    address: str | None = None,
    dashboard_port: int | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout_s: float = 120,
) -> RayConnection:
    """Connect to the Ray cluster whose dashboard is at ``address`` (e.g.
    ``http://head:8265``) or, when it is None, to the local head ``state_dir`` owns, starting
    it if it does not answer (and waiting for it; :class:`HeadError` says why it cannot)."""
    if address is not None:
        return connection_to(state_dir, address)
    head = LocalHead(state_dir, dashboard_port, num_cpus, num_gpus, timeout_s=timeout_s)
    connection = head.connection
    if probe(connection) is None:
        return connection
    head.launch(connection)
    return replace(connection, started_here=True, record=head.record)
