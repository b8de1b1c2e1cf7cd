"""Two coordinators on one data directory: the second is refused, the first keeps serving (issue #7: 15)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import tally
from tally_server.testing import running_server
from tests.integration.workload import tree

TALLY = str(Path(sys.executable).parent / "tally")


def serve(data_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``tally serve`` on free ports; returns when it exits (a coordinator that starts never does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    command = [TALLY, "serve", "--data-dir", str(data_dir), "--grpc-listen", "127.0.0.1:0"]
    command += ["--http-listen", "127.0.0.1:0"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_a_second_coordinator_on_the_same_data_directory_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, settle_ms=0) as first, tally.Client(first.grpc_address) as client:
        with client.writer("shared/run", writer_id="w1") as w:
            w.apply_deltas(tree("a"))

        second = serve(data_dir)

        assert second.returncode != 0
        assert second.stdout == ""
        (line,) = second.stderr.strip().splitlines()
        assert f"data directory {data_dir} is in use by another tally serve" in line
        assert f"(pid {first.process.pid} on host {socket.gethostname()}, started " in line
        assert "stop that one first, or give this one another --data-dir" in line
        # The first one never noticed: it still serves and still writes.
        with client.writer("shared/run", writer_id="w2") as w:
            w.apply_deltas(tree("b"))
        assert client.are_completed("shared/run", ["a", "b"]) == [True, True]
        assert first.process.poll() is None


def test_a_coordinator_killed_with_sigkill_does_not_block_the_next_one(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with running_server(data_dir, settle_ms=0) as first:
        with tally.Client(first.grpc_address) as client, client.writer("shared/run", writer_id="w1") as w:
            w.apply_deltas(tree("a"))
        first.kill()
    assert (data_dir / ".tally.lock").exists()  # left behind; the kernel released the lock itself

    with running_server(data_dir, settle_ms=0) as second, tally.Client(second.grpc_address) as client:
        assert client.are_completed("shared/run", ["a"]) == [True]
        assert str(second.process.pid) in (data_dir / ".tally.lock").read_text()
