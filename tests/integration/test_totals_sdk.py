"""Declared totals through the SDK and the ``tally`` command against a real server: declare (ids,
chunked; a count), writer(expected_sources=), remaining, status on both wires; ``tally remaining``
in a pipe, ``tally status`` and ``tally watch --once`` with a total."""

from __future__ import annotations

import os
import subprocess

import pytest

import tally
from tally import _calls as calls
from tally_server.testing import RunningServer
from tests.integration.test_cli import TALLY, ok, run
from tests.integration.workload import tree


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_sdk_declares_and_lists_remaining(server: RunningServer, wire: str) -> None:
    address = server.grpc_address if wire == "grpc" else server.http_url
    cp = f"totals/{wire}"
    ids = [f"s{i:05d}" for i in range(calls.DECLARE_CHUNK + 3)]  # two DeclareSources calls
    with tally.Client(address) as client:
        assert client.declare(cp, ids) == len(ids)
        assert client.declare(cp, ids[:5]) == len(ids)  # idempotent
        with client.writer(cp, writer_id="w", expected_sources=["extra"]) as w:
            w.apply_deltas(tree("s00001") + tree("extra"))
            w.flush()
        status = client.checkpoint(cp)
        assert (status.total, status.completed_count) == (len(ids) + 1, 2)
        assert status.remaining == len(ids) - 1
        assert status.percent == pytest.approx(100 * 2 / (len(ids) + 1))
        left = list(client.remaining(cp, page_size=4000))
        assert len(left) == len(ids) - 1 and left == sorted(left)
        assert "s00001" not in left and "extra" not in left and left[0] == "s00000"
        listed = {c.name: c for c in client.checkpoints()}
        assert listed[cp].total == len(ids) + 1


def test_a_count_gives_a_total_without_ids(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        assert client.declare("totals/count", count=40) == 40
        status = client.checkpoint("totals/count")
        assert status.total == 40 and status.percent == 0.0
        assert list(client.remaining("totals/count")) == []
        assert client.declare("totals/none", []) == 0  # creates the checkpoint, declares nothing
        plain = client.checkpoint("totals/none")
        assert plain.total == 0 and plain.remaining == -1 and plain.percent is None


def test_cli_remaining_status_and_watch(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        client.declare("cli/totals", ["a", "b", "c", "d"])
        with client.writer("cli/totals", writer_id="w") as w:
            w.apply_deltas(tree("b"))
    result = run("remaining", "cli/totals", address=server.grpc_address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["a", "c", "d"]
    assert "3 remaining sources of cli/totals (of 4 declared)" in result.stderr

    # In a real pipe whose reader stops early: no traceback, no error.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env["TALLY_ADDRESS"] = server.grpc_address
    piped = subprocess.run(
        f"'{TALLY}' remaining cli/totals | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert piped.returncode == 0 and piped.stdout == "a\n"
    assert "Traceback" not in piped.stderr, piped.stderr

    status = ok("status", "cli/totals", address=server.grpc_address)
    assert "4 declared (25.0 % completed)" in status and "3 (tally remaining cli/totals lists them)" in status
    once = ok("watch", "cli/totals", "--once", address=server.http_url)
    assert "completed 1 of 4 (25.0 %)" in once and "remaining 3" in once and "ETA unknown" in once
