"""The local Ray head is the state dir's own (issue 42), checked without Ray: its temp dir and
ports are chosen free and recorded; ``ray start`` gets them, and no ``RAY_ADDRESS``; a head
that cannot start says why in one line, naming what to set; it is stopped by its own process
ids, and nothing else on the machine is."""

from __future__ import annotations

import http.server
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.server import free_port
from service.cluster import head
from service.cluster.head import (
    HEAD_FILE,
    WORKER_PORTS,
    HeadRecord,
    LocalHead,
    load_record,
    own_record,
    port_taken,
    stop_head,
)
from service.orchestration import OrchestratorUnavailable


@pytest.fixture(autouse=True)
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


def test_each_state_dir_records_its_own_free_ports_and_temp_dir(tmp_path: Path) -> None:
    records = [own_record(tmp_path / f"state{i}") for i in range(4)]
    for i, record in enumerate(records):
        path = tmp_path / f"state{i}" / HEAD_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert own_record(path.parent) == load_record(path.parent) == record  # kept
        ports = list(record.listening_ports().values())
        assert len(set(ports)) == len(ports) and not any(map(port_taken, ports))
        workers = range(record.min_worker_port, record.max_worker_port + 1)
        assert len(workers) == WORKER_PORTS and workers.stop <= 32768
        assert not set(ports) & set(workers)
        # short (Ray's socket paths), and not in the state dir, which no Ray process may learn
        assert len(str(record.temp_dir)) < 32 and not record.temp_dir.is_relative_to(tmp_path)
    assert len({r.temp_dir for r in records}) == len({r.gcs_port for r in records}) == 4
    assert len({r.dashboard_port for r in records}) == 4


def test_a_pinned_dashboard_port_replaces_the_recorded_one(tmp_path: Path) -> None:
    first = own_record(tmp_path)
    pinned = own_record(tmp_path, dashboard_port=8299)
    assert pinned == first.model_copy(update={"dashboard_port": 8299}) == load_record(tmp_path)


@pytest.fixture
def ray_start(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, Any]]]:
    """``ray start`` (and waiting for the head) faked: each call's command and arguments."""
    calls: list[tuple[list[str], dict[str, Any]]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(head.subprocess, "run", run)
    monkeypatch.setattr(head, "_wait_until_up", lambda *_: None)
    return calls


def test_ray_start_gets_the_heads_own_temp_dir_and_ports_and_no_ray_address(
    ray_start, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a foreign cluster, left alone
    monkeypatch.setenv("DPTUNE_OPERATOR_KEY", "dpt_operator-key-0123456789")
    local = LocalHead(tmp_path / "state", cwd=tmp_path)
    local.launch(local.connection)
    record = load_record(tmp_path / "state")
    assert record is not None and local.started
    [(cmd, kwargs)] = ray_start
    assert cmd[1:3] == ["start", "--head"]
    assert f"--temp-dir={record.temp_dir}" in cmd and f"--port={record.gcs_port}" in cmd
    for name, port in record.model_dump().items():
        if name.endswith("_port") and name != "gcs_port":
            assert f"--{name.replace('_', '-')}={port}" in cmd
    assert not any(name == "RAY_ADDRESS" or "DPTUNE" in name for name in kwargs["env"])
    assert record.temp_dir.is_dir() and stat.S_IMODE(record.temp_dir.stat().st_mode) == 0o700
    record.temp_dir.rmdir()


@contextmanager
def listening(port: int) -> Iterator[None]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def test_ports_taken_since_are_chosen_anew_but_the_dashboards(ray_start, tmp_path: Path) -> None:
    before = own_record(tmp_path)
    with listening(before.gcs_port), listening(before.min_worker_port + 7):
        local = LocalHead(tmp_path)
        local.launch(local.connection)
    after = load_record(tmp_path)
    assert after is not None and after.dashboard_port == before.dashboard_port
    assert after.gcs_port != before.gcs_port and after.min_worker_port != before.min_worker_port
    assert after.temp_dir == before.temp_dir
    before.temp_dir.rmdir()


#: the ports a head listens on but its dashboard's, in the record's order
OTHER_PORTS = [
    name
    for name in HeadRecord.model_fields
    if name.endswith("_port") and "worker" not in name and name != "dashboard_port"
]


@given(st.data())
@settings(max_examples=50, deadline=None)
def test_no_two_components_of_a_head_share_a_port(data: st.DataObject) -> None:
    """A record can repeat a port — a pinned dashboard port that another component holds, a
    port drawn while another was chosen but not yet listened on — and its workers' range can
    hold the dashboard's port. Before ``ray start``, each component gets a port of its own,
    the dashboard keeps its own, and a port held once stays."""
    pool = head.free_ports(3)
    low = head._free_worker_range()
    dashboard = data.draw(st.sampled_from([*pool, low + 5]), label="dashboard")
    ports = {n: data.draw(st.sampled_from([dashboard, *pool]), label=n) for n in OTHER_PORTS}
    record = head.choose_record().model_copy(
        update={
            "dashboard_port": dashboard,
            **ports,
            "min_worker_port": low,
            "max_worker_port": low + WORKER_PORTS - 1,
        }
    )
    fresh = head._with_free_ports(record)
    listening = list(fresh.listening_ports().values())
    assert fresh.dashboard_port == dashboard and len(set(listening)) == len(listening)
    assert not set(listening) & set(range(fresh.min_worker_port, fresh.max_worker_port + 1))
    held = {dashboard}
    for name, port in ports.items():
        if port not in held:
            assert getattr(fresh, name) == port
            held.add(port)


def test_a_pinned_dashboard_port_is_not_drawn_for_another_component(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens on a pinned dashboard port before its head starts, so the kernel may
    hand it out when the other ports are drawn: it is not given twice."""
    pinned, *others = head.free_ports(len(OTHER_PORTS) + 2)
    handed = iter([pinned, *others])

    class Kernel(socket.socket):
        """Hands out ``pinned`` first, as bind(0) may."""

        def getsockname(self) -> tuple[str, int]:
            return ("0.0.0.0", next(handed))

    monkeypatch.setattr(head.socket, "socket", Kernel)
    ports = list(head.choose_record(pinned).listening_ports().values())
    assert ports.count(pinned) == 1 and len(set(ports)) == len(ports)


class Refuses(http.server.BaseHTTPRequestHandler):
    """A Ray dashboard that is not ours: it refuses our token."""

    status = 403

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


class Accepts(Refuses):
    """A Ray dashboard that takes our token."""

    status = 200


@contextmanager
def foreign_dashboard(port: int, handler: type[Refuses] = Refuses) -> Iterator[None]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _fail_start(monkeypatch: pytest.MonkeyPatch) -> None:
    traceback = "Traceback (most recent call last):\n  File x\n    raise\nConnectionError: boom\n"
    monkeypatch.setattr(
        head.subprocess,
        "run",
        lambda cmd, **_: subprocess.CompletedProcess(cmd, 1, "", f"\x1b[31m{traceback}\x1b[0m"),
    )


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head.shutil, "which", lambda *_, **__: None)


def _legacy_head(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A head an older dptune started for this state dir: on the old port, with its token."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-state-dirs-token")
    monkeypatch.setattr(head, "LEGACY_DASHBOARD_PORT", port := free_port())
    return foreign_dashboard(port, Accepts)


CASES: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "token refused": (
        foreign_dashboard,
        ("refuses its Ray token", "DPTUNE_RAY_DASHBOARD_PORT", "DPTUNE_RAY_ADDRESS=http://"),
    ),
    "port taken": (listening, ("taken by another process", "DPTUNE_RAY_DASHBOARD_PORT")),
    "ray missing": (_no_ray, ("not installed", "DPTUNE_RAY_ADDRESS")),
    "ray start fails": (_fail_start, ("`ray start` failed: ConnectionError: boom",)),
    "an older head": (_legacy_head, ("older dptune", "DPTUNE_RAY_ADDRESS=http://127.0.0.1:")),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_head_that_cannot_start_says_why_in_one_line(
    case: tuple[Callable[..., Any], tuple[str, ...]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    cause, expected = case
    local = LocalHead(tmp_path)
    port = local.record.dashboard_port
    if cause in (foreign_dashboard, listening):
        context = cause(port)
    else:
        context = cause(monkeypatch) or listening(0)
    refused = pytest.raises(OrchestratorUnavailable, match="could not start the local Ray head")
    with context, caplog.at_level(logging.WARNING, logger=head.__name__), refused:
        local.start(local.connection)
    [line] = [r.getMessage() for r in caplog.records if r.name == head.__name__]
    assert local.why is not None and local.why in line
    assert "\n" not in line and "Traceback" not in line
    assert all(part in local.why for part in expected), local.why
    with pytest.raises(OrchestratorUnavailable):  # no second try within retry_s
        local.start(local.connection)
    if local.record.temp_dir.exists():
        local.record.temp_dir.rmdir()


def _sleeper(*args: str, ignore_term: bool = False, child: bool = False) -> subprocess.Popen[str]:
    """A process whose command line holds ``args``, optionally deaf to SIGTERM or with a
    child that names nothing (as Ray's workers)."""
    code = "import signal, subprocess, sys, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    if child:
        code += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    code += "print('ready', flush=True)\ntime.sleep(60)\n"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no parent reaped yet does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_ends_the_heads_processes_and_no_other(tmp_path: Path) -> None:
    record = own_record(tmp_path)
    temp, gcs = str(record.temp_dir), record.gcs_port
    ours = [
        _sleeper(f"--temp-dir={temp}", child=True),  # the raylet and its workers
        _sleeper(f"--log-dir={temp}/session_1/logs", ignore_term=True),
        _sleeper("-m", "ray.util.client.server", f"--address=10.0.0.2:{gcs}"),
    ]
    others = [
        _sleeper(f"--temp-dir={temp}0"),  # another head, whose temp dir starts like ours
        _sleeper("-m", "ray.util.client.server", f"--address=127.0.0.1:{gcs}0"),
        _sleeper("-m", "some.server", f"--address=127.0.0.1:{gcs}"),
    ]
    try:
        found = {p.pid for p in head.head_processes(record)}
        assert {p.pid for p in ours} < found and len(found) == len(ours) + 1  # + the child
        assert sorted(found) == stop_head(record, grace_s=0.5)
        assert not head.head_processes(record)
        assert not any(map(running, found))
        assert all(p.poll() is None for p in others)
    finally:
        for p in ours + others:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
