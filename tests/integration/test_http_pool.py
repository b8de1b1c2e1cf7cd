"""The HTTP transport keeps its connections (issue 13): one Client's calls share a keep-alive pool.

Before, each HTTP call opened a TCP connection of its own (200 calls left 201 sockets in
TIME_WAIT); the asyncio client ran the blocking transport in worker threads. The server's access
log names each request's peer (address and port), so the connections it saw are counted there;
the client's side in /proc (its sockets' entries in /proc/net/tcp).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

CALLS = 200
CHECKPOINT = "pool/run"


@pytest.fixture
def json_server(tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(tmp_path / "data", settle_ms=0, args=["--log-format", "json"]) as srv:
        with tally.Client(srv.grpc_address) as client, client.writer(CHECKPOINT) as w:
            w.apply_deltas(tree("done"))
        yield srv


def peers(server: RunningServer, path: str, expected: int) -> list[str]:
    """The peer (client address:port) of each access line for ``path``, once ``expected`` are logged."""

    def found() -> list[str]:
        entries = [json.loads(line) for line in server.log().splitlines() if line.strip()]
        return [e["peer"] for e in entries if e.get("transport") == "http" and e.get("path") == path]

    wait_until(lambda: len(found()) >= expected, timeout=30, what=f"{expected} access lines for {path}")
    return found()


def connections_to(port: int) -> int:
    """This process's established TCP connections to ``port`` (its sockets found in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself had open
            continue
        if link.startswith("socket:["):
            inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            established = fields[3] == "01"
            count += established and remote_port == port and fields[9] in inodes
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's connections in /proc")
def test_one_client_makes_its_calls_over_one_connection_and_closing_it_closes_that(
    json_server: RunningServer,
) -> None:
    port = int(json_server.http_address.rsplit(":", 1)[1])
    client = tally.Client(json_server.http_url)
    for _ in range(CALLS):
        assert client.are_completed(CHECKPOINT, ["done", "not"]) == [True, False]
    kept = connections_to(port)
    client.close()
    left = connections_to(port)

    seen = peers(json_server, "/v1/are-completed", CALLS)
    assert len(seen) == CALLS
    # One connection; a second only if the first was dropped idle (30 s) on a stalled machine.
    assert len(set(seen)) <= 2, sorted(set(seen))
    assert kept == 1 and left == 0, (kept, left)


def test_async_calls_run_concurrently_on_one_event_loop_without_threads(json_server: RunningServer) -> None:
    concurrent = 10

    async def main() -> dict[str, Any]:
        threads = threading.active_count()
        async with tally.AsyncClient(json_server.http_url) as client:
            # A watch waits on its stream while the calls below go on beside it, on this loop.
            stream = client.watch(CHECKPOINT, interval_s=0.1).__aiter__()
            first = await anext(stream)
            answers = await asyncio.gather(
                *(client.are_completed(CHECKPOINT, ["done"]) for _ in range(concurrent))
            )
            sequential = [await client.are_completed(CHECKPOINT, ["done"]) for _ in range(CALLS)]
            await stream.aclose()  # type: ignore[attr-defined]
            return {
                "first": first,
                "answers": answers,
                "sequential": sequential,
                "threads": threading.active_count() - threads,
                "executor": [t.name for t in threading.enumerate() if t.name.startswith("asyncio_")],
            }

    result = asyncio.run(main())
    assert result["first"].completed_count == 1
    assert result["answers"] == [[True]] * concurrent and result["sequential"] == [[True]] * CALLS
    # No worker thread was started for any of it (asyncio.to_thread's are named asyncio_N).
    assert result["threads"] == 0 and result["executor"] == []
    seen = peers(json_server, "/v1/are-completed", concurrent + CALLS)
    # The gathered calls were in flight together: each needed a connection of its own...
    assert len(set(seen[:concurrent])) == concurrent, seen[:concurrent]
    # ... and the sequential ones went over the pool's kept connections, opening none.
    assert set(seen[concurrent:]) <= set(seen[:concurrent])


def run_without_httpx(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter in which ``import httpx`` fails, as without ``[http]``."""
    prelude = "import sys\nsys.modules['httpx'] = None\nimport tally\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("client", ["Client", "AsyncClient"])
def test_an_http_address_without_httpx_fails_at_creation_saying_what_to_install(client: str) -> None:
    result = run_without_httpx(f"tally.{client}('http://127.0.0.1:8080')\n")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: the HTTP address http://127.0.0.1:8080 needs httpx"), last
    assert "pip install 'tally-client[http]'" in last


def test_grpc_users_need_no_httpx(server: RunningServer) -> None:
    result = run_without_httpx(
        f"with tally.Client({server.grpc_address!r}) as client:\n"
        "    assert client.are_completed('pool/none', ['a']) == [False]\n"
        "assert 'httpx' not in {k for k, v in sys.modules.items() if v is not None}\n"
        "print('ok')\n"
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_opens_connections_of_its_own(json_server: RunningServer) -> None:
    # A pool copied by fork holds the parent's connections: the child's requests must not go
    # out on them, interleaved with the parent's.
    with tally.Client(json_server.http_url) as client:
        assert client.are_completed(CHECKPOINT, ["done"]) == [True]  # the pool has a connection now
        (parent,) = set(peers(json_server, "/v1/are-completed", 1))
        with warnings.catch_warnings():  # Python 3.12+ warns of fork in a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            code = 1
            try:
                answers = [client.are_completed(CHECKPOINT, ["done", "x"]) for _ in range(20)]
                code = 0 if answers == [[True, False]] * 20 else 2
            finally:
                os._exit(code)
        answers = [client.are_completed(CHECKPOINT, ["done"]) for _ in range(20)]
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert answers == [[True]] * 20
        seen = peers(json_server, "/v1/are-completed", 41)
    # The parent kept its connection; the child's 20 calls came over another one.
    assert seen.count(parent) == 21 and len(set(seen)) == 2, seen


def test_a_writer_heartbeats_over_the_connection_it_opened_on(tmp_path: Path) -> None:
    # A lease of 15 s: a keep-alive every 5 s, so the pool must keep an idle connection longer than
    # that (it kept it 3 s, and each beat of a process's one writer opened a connection: with TLS,
    # a handshake every beat).
    args = ["--log-format", "json", "--log-level", "DEBUG"]
    with running_server(tmp_path / "data", lease_ttl_s=15, args=args) as srv:
        with tally.Client(srv.http_url) as client, client.writer(CHECKPOINT, writer_id="beats") as writer:
            writer.apply_deltas(tree("a"))
            writer.flush()
            handle = writer.handle
            beats = peers(srv, f"/v1/writers/{handle}/keepalive", 2)
            flushes = peers(srv, f"/v1/writers/{handle}/flush", 1)
        assert len(set(beats[:2] + flushes)) == 1, (beats, flushes)
