"""Heartbeats are never lost to the coordinator's own slowness (issue 7, point 6).

A coordinator that is stopped, overloaded or swapped out does not hear heartbeats; it must not then
expire the writers that sent them. And status reads, however many, never make heartbeats wait.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

TTL = 2.0


def expired_writers(server: RunningServer, checkpoint: str) -> list[str]:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        events = http.get("/v1/events", params={"checkpoint": checkpoint, "limit": 1000}).json()["events"]
    return [e["writer_id"] for e in events if e["kind"] == "writer_expired"]


@contextmanager
def stopped(server: RunningServer) -> Iterator[None]:
    """The coordinator process is frozen (SIGSTOP) for the block: it hears nothing."""
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


def test_a_frozen_coordinator_does_not_expire_the_writers_it_could_not_hear(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=TTL) as server:
        with tally.Client(server.grpc_address, timeout=5) as client, ExitStack() as writers:
            ws = [writers.enter_context(client.writer("stall/frozen", writer_id=f"w{i}")) for i in range(3)]
            for i, w in enumerate(ws):
                w.apply_deltas(tree(f"s{i}")[:3])  # half a tree: pending state that must survive
                w.flush()
            with stopped(server):
                # Three leases' worth of silence, measured by this process, not the coordinator.
                deadline = time.monotonic() + 3 * TTL
                while time.monotonic() < deadline:
                    time.sleep(0.1)
            for i, w in enumerate(ws):
                w.apply_deltas(tree(f"s{i}")[3:])
                w.flush()  # raises LeaseLost if the coordinator had expired the writer
                assert not w.health().lease_lost
            assert client.are_completed("stall/frozen", ["s0", "s1", "s2"]) == [True, True, True]
        assert expired_writers(server, "stall/frozen") == []


def test_a_writer_that_died_still_expires_after_a_stall(tmp_path: Path) -> None:
    """Stalls pause the lease clock; they do not stop it."""
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=TTL) as server:
        with httpx.Client(base_url=server.http_url, timeout=10) as http:
            # Raw HTTP: nobody heartbeats for this writer, as if its process had died.
            opened = http.post("/v1/writers", json={"checkpoint": "stall/dead", "writer_id": "gone"})
            assert opened.status_code == 200
            with stopped(server):
                deadline = time.monotonic() + 2 * TTL
                while time.monotonic() < deadline:
                    time.sleep(0.1)
            wait_until(
                lambda: http.get("/v1/checkpoints/stall/dead").json()["live_writers"] == 0,
                timeout=10 * TTL,
                what="the dead writer expired",
            )
        assert expired_writers(server, "stall/dead") == ["gone"]


# Run in processes of their own, as real readers are: threads in the test process would starve the
# SDK's heartbeat threads of the GIL, which says nothing about the coordinator.
READER = """
import os, sys, threading, time, httpx
os.nice(10)  # on a small test machine, readers must not also starve the writers' own process
url, threads, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
paths = ("/v1/checkpoints", "/v1/checkpoints/storm/0", "/v1/writers?checkpoint=storm/0")
counts = {"ok": 0, "bad": 0}
def read():
    with httpx.Client(base_url=url, timeout=60) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for path in paths:
                counts["ok" if http.get(path).status_code == 200 else "bad"] += 1
workers = [threading.Thread(target=read) for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(counts["ok"], counts["bad"])
"""


def test_a_read_storm_expires_no_healthy_writer(tmp_path: Path) -> None:
    """50 concurrent readers hammering status while 60 idle writers heartbeat: none loses its lease."""
    processes, threads, writers_n, storm_s = 5, 10, 60, 4 * TTL
    with running_server(tmp_path / "data", settle_ms=0, lease_ttl_s=TTL) as server:
        with tally.Client(server.grpc_address, timeout=10) as client, ExitStack() as stack:
            writers = [
                stack.enter_context(client.writer(f"storm/{i % 4}", writer_id=f"w{i}"))
                for i in range(writers_n)
            ]
            storm = [
                subprocess.Popen(
                    [sys.executable, "-c", READER, server.http_url, str(threads), str(storm_s)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for _ in range(processes)
            ]
            answers = [tuple(map(int, p.communicate(timeout=120)[0].split())) for p in storm]
            lost = [w.writer_id for w in writers if w.health().lease_lost]
            for w in writers:
                w.flush()  # a writer the coordinator expired would raise LeaseLost here
        assert sum(ok for ok, _ in answers) > processes * threads, "the storm did not happen"
        assert [bad for _, bad in answers] == [0] * processes
        assert lost == []
        assert [w for i in range(4) for w in expired_writers(server, f"storm/{i}")] == []
