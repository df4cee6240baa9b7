"""A Ray cluster of separate nodes on this machine, each started with ``ray start`` in its own
temp dir and on its own ports, token auth on — for tests that need a second node, or kill one.

Never ``ray stop`` here: it ends every Ray process on the machine, other tests' heads
included. A node is stopped by killing its own processes: those whose command line names its
temp dir (raylet, GCS, dashboard, agents) and all their descendants (the workers, which Ray
renames ``ray::…``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.cluster import RayConnection
from service.cluster.head import free_ports

HOST = "127.0.0.1"
#: Ray's own health checks, tightened so that a killed node is declared dead within seconds
FAST_FAILURE_DETECTION = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def _ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def _parent(pid: int) -> int | None:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"


def process_tree(marker: str) -> set[int]:
    """PIDs of the processes whose command line contains ``marker``, and their descendants."""
    found: set[int] = set()
    parents: dict[int, int | None] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        parents[pid] = _parent(pid)
        try:
            if marker.encode() in (proc / "cmdline").read_bytes():
                found.add(pid)
        except OSError:  # ended meanwhile
            continue
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    found.discard(os.getpid())
    return found


#: the ``ray start`` flags of the ports a node listens on, and a head's too (``port``: the GCS)
NODE_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
)
HEAD_PORTS = ("ray-client-server-port", "port", "dashboard-port")


def _ports(head: bool) -> dict[str, int]:
    """Free ports for one node by flag, held open together while they are chosen: two raylets
    on one machine must not share any, nor two components of one (ports drawn one at a time
    can repeat, and ``ray start`` then refuses)."""
    flags = NODE_PORTS + (HEAD_PORTS if head else ())
    return dict(zip(flags, free_ports(len(flags)), strict=True))


@dataclass
class Node:
    temp_dir: Path
    head: bool
    id: str = ""  # Ray's node id, known once the node has registered

    def processes(self) -> set[int]:
        return process_tree(str(self.temp_dir))

    def kill(self) -> None:
        """kill -9 the node's processes at once, as if its machine died."""
        for pid in self.processes():
            with suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)


@dataclass
class LocalCluster:
    root: Path
    token_path: Path
    #: the first of the workers' ports, 50 per node; below the ephemeral ports (32768 on) and
    #: above those of the session's head (10002–19999)
    worker_ports: int = field(default_factory=lambda: 20000 + 500 * secrets.randbelow(20))
    gcs_address: str = ""
    dashboard_url: str = ""
    nodes: list[Node] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    @property
    def connection(self) -> RayConnection:
        return RayConnection(self.dashboard_url, self.token, started_here=False)

    def env(self) -> dict[str, str]:
        """The environment of a ``ray start``: no ``DPTUNE_*`` setting of the test process,
        this cluster's token."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_", "RAY_"))}
        return {
            **env,
            **FAST_FAILURE_DETECTION,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
        }

    def _start(self, head: bool, num_cpus: int, num_gpus: int = 0) -> Node:
        node = Node(Path(tempfile.mkdtemp(prefix="n", dir=self.root)), head)
        ports, low = _ports(head), self.worker_ports + 50 * len(self.nodes)
        cmd = [
            _ray_cli(),
            "start",
            f"--temp-dir={node.temp_dir}",
            f"--node-ip-address={HOST}",
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            f"--object-store-memory={100 * 1024**2}",
            "--disable-usage-stats",
            f'--resources={{"{node.temp_dir.name}": 1}}',  # tells the node in Ray's state API
            *(f"--{flag}={port}" for flag, port in ports.items()),
            f"--min-worker-port={low}",  # its workers': 50 from low on
            f"--max-worker-port={low + 49}",
        ]
        if head:
            self.gcs_address = f"{HOST}:{ports['port']}"
            self.dashboard_url = f"http://{HOST}:{ports['dashboard-port']}"
            cmd += ["--head", f"--dashboard-host={HOST}"]
        else:
            cmd.append(f"--address={self.gcs_address}")
        self.nodes.append(node)  # stopped with the cluster even if it fails to start
        done = subprocess.run(
            cmd, env=self.env(), capture_output=True, text=True, timeout=180, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return node

    def start_head(self, num_cpus: int = 1, num_gpus: int = 0) -> Node:
        return self._start(True, num_cpus, num_gpus)

    def add_worker(self, num_cpus: int = 1) -> Node:
        return self._start(False, num_cpus)

    def state(self, resource: str) -> list[dict[str, Any]]:
        """Ray's state API (``ray list <resource>``) over HTTP, with this cluster's token."""
        r = httpx.get(
            f"{self.dashboard_url}/api/v0/{resource}",
            params={"limit": 1000, "detail": "true"},
            headers=self.connection.headers,
            timeout=30,
        )
        r.raise_for_status()
        return list(r.json()["data"]["result"]["result"])

    def wait_for_nodes(self, timeout: float = 120) -> None:
        """Wait until every started node is alive in the cluster, and learn the node ids."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = [n for n in self.state("nodes") if n["state"] == "ALIVE"]
            except httpx.HTTPError:
                alive = []
            if len(alive) == len(self.nodes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(alive)} of {len(self.nodes)} Ray nodes alive: {alive}")
            time.sleep(1)
        for node in self.nodes:
            node.id = next(
                n["node_id"] for n in alive if node.temp_dir.name in n["resources_total"]
            )

    def stop(self) -> None:
        """Kill every process of every node and remove the temp dirs. The head's Ray client
        server does not name the node's temp dir; it is found by the GCS port it serves."""
        for node in self.nodes:
            node.kill()
        if self.gcs_address:
            port = self.gcs_address.rsplit(":", 1)[1]
            for pid in process_tree("ray.util.client.server") & process_tree(f":{port}\0"):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(n.processes() for n in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)


def token_root(prefix: str) -> tuple[Path, Path]:
    """A new short root directory holding a fresh Ray token: (root, token path). Short,
    because Ray's Unix sockets live under it and their paths must stay under 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    token_path = root / "auth_token"
    token_path.touch(mode=0o600)
    token_path.write_text(secrets.token_hex(32))
    return root, token_path


@contextmanager
def local_cluster() -> Iterator[LocalCluster]:
    """A cluster with no nodes yet; every node started in it is killed on the way out — also
    when the process is sent SIGTERM (``kill``, a bench stopped early), which by default ends
    Python without running ``finally`` blocks and left whole clusters running."""
    cluster = LocalCluster(*token_root("dpt-ray-"))
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit) if main else None
    try:
        yield cluster
    finally:
        cluster.stop()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
