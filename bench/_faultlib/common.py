"""What every fault scenario shares: its result row, real servers that are always reaped, and probes.

A scenario returns a :class:`Row`. Cells that must be 0 (lost, false, healthy writers expired, 5xx,
files outside the data dir) are counts; any other expectation that failed is a line in
``Row.failed``. Both make the campaign exit non-zero.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tally_server.testing import RunningServer, running_server

REPO = Path(__file__).resolve().parents[2]

# Every server process a scenario started, so a campaign interrupted anywhere still reaps them.
_PROCESSES: dict[int, subprocess.Popen[str]] = {}
_PROCESSES_LOCK = threading.Lock()


@dataclass
class Row:
    """One scenario's outcome: the table row plus the figures behind it."""

    scenario: str
    trials: int = 1
    lost: int = 0
    false: int = 0
    expired: int = 0
    errors: int = 0  # HTTP 5xx, gRPC INTERNAL or UNKNOWN answers
    outside: int = 0  # files created or written outside the data dir
    recovered: str = "-"  # writers recovered without replay, where the scenario measures it
    notes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # expectations other than the zero cells
    skipped: str | None = None
    seconds: float = 0.0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def zero_cells_ok(self) -> bool:
        return not (self.lost or self.false or self.expired or self.errors or self.outside)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or (self.zero_cells_ok and not self.failed)

    def check(self, condition: bool, failure: str) -> None:
        """Record ``failure`` unless ``condition`` holds."""
        if not condition:
            self.failed.append(failure)


@contextlib.contextmanager
def serve(data_dir: Path, **kwargs: Any) -> Iterator[RunningServer]:
    """``running_server``, its process tracked (see :func:`kill_all`) and SIGKILLed if it hangs on exit."""
    with running_server(data_dir, **kwargs) as server:
        with _PROCESSES_LOCK:
            _PROCESSES[server.process.pid] = server.process
        try:
            yield server
        finally:
            # running_server waits 60 s for a graceful exit; a server busy with an attack gets less.
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
                try:
                    server.process.wait(20)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait(30)
            with _PROCESSES_LOCK:
                _PROCESSES.pop(server.process.pid, None)


def kill_all() -> int:
    """SIGKILL every tracked server still running; returns how many there were."""
    with _PROCESSES_LOCK:
        alive = [p for p in _PROCESSES.values() if p.poll() is None]
        _PROCESSES.clear()
    for process in alive:
        process.kill()
        process.wait(30)
    return len(alive)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary directory removed afterwards, even if a server left files in it."""
    path = Path(tempfile.mkdtemp(prefix=f"tally-fault-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (0 once it is gone)."""
    return _status_field(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """High-water mark of the resident set size of a process (0 once it is gone)."""
    return _status_field(pid, "VmHWM")


def cpu_seconds(pid: int) -> float:
    """The user and system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_field(pid: int, name: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


TRACEBACK_HEAD = "Traceback (most recent call last)"


def tracebacks(log: str) -> int:
    return log.count(TRACEBACK_HEAD)


def traceback_ends(log: str) -> dict[str, int]:
    """The exception line ending each traceback in ``log`` (what was raised), with how often."""
    ends: dict[str, int] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if TRACEBACK_HEAD not in line:
            continue
        # The exception line is the first one after the frames that is not indented.
        for follow in lines[i + 1 :]:
            if follow and not follow.startswith((" ", "\t")):
                ends[follow[:200]] = ends.get(follow[:200], 0) + 1
                break
    return ends


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def events(
    http_url: str, checkpoint: str, kind: str | None = None, timeout: float = 60
) -> list[dict[str, Any]]:
    """Every event of a checkpoint (optionally of one kind), read through the HTTP API page by page."""
    found: list[dict[str, Any]] = []
    before = 0
    with httpx.Client(base_url=http_url, timeout=timeout) as http:
        while True:
            params: dict[str, Any] = {"checkpoint": checkpoint, "limit": 500}
            if before:
                params["before_id"] = before
            reply = http.get("/v1/events", params=params)
            if reply.status_code == 404:
                return found
            reply.raise_for_status()
            page = reply.json()
            found += [e for e in page["events"] if kind is None or e["kind"] == kind]
            before = page["next_before_id"]
            if not before:
                return found


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def is_root() -> bool:
    return os.geteuid() == 0
