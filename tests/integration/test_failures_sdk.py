"""Failure budgets through the SDK and the CLI against real ``tally serve`` processes, on both stores:
a budget of 2 makes a source failed after two reported failures; status counts it; ``failures()``
lists its reasons; it survives a coordinator's kill -9; completing the source or ``retry_failed``
clears it; ``tally failed`` / ``tally retry`` work in a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tally
from tally_server.testing import running_server
from tests.integration.workload import tree

TALLY = str(Path(sys.executable).parent / "tally")
LONG_ID = "s3://bucket/" + "a-long-prefix/" * 10 + "part-00042.jsonl"


def cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    # stdin and stdout are pipes: no terminal, no truncation, no question asked.
    return subprocess.run(
        [TALLY, *args, "--address", address],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )


def test_a_budget_fails_a_source_until_completed_or_retried_across_a_kill(
    tmp_path: Path, store: str | None
) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=store) as server:
        with tally.Client(server.grpc_url) as client, client.writer("fb/run", max_attempts=2) as w:
            first = w.report_failure(LONG_ID, "oom on row 7")
            assert (first.attempts, first.failed, first.max_attempts) == (1, False, 2)
            w.report_failure("other", "once")
            second = w.report_failure(LONG_ID, "Traceback:\n  ValueError: bad row")
            assert (second.attempts, second.failed) == (2, True)
            status = client.checkpoint("fb/run")
            assert (status.failed_sources, status.max_attempts) == (1, 2)
            [found] = client.failures("fb/run", failed_only=True)
            assert (found.source_id, found.attempts, found.failed) == (LONG_ID, 2, True)
            assert [a.reason for a in found.recent] == ["oom on row 7", "Traceback:\n  ValueError: bad row"]
            assert {a.writer_id for a in found.recent} == {w.writer_id} and found.recent[0].at > 0
            assert [f.source_id for f in client.failures("fb/run")] == ["other", LONG_ID]  # by id
            named = client.failures("fb/run", source_ids=["other", "nobody"])
            assert [(f.source_id, f.failed) for f in named] == [("other", False)]
        server.kill()  # durable when report_failure returned
    with running_server(data, settle_ms=0, store=store) as again:
        with tally.Client(again.grpc_url) as client:
            status = client.checkpoint("fb/run")
            assert (status.failed_sources, status.max_attempts) == (1, 2)
            assert [(f.source_id, f.attempts) for f in client.failures("fb/run")] == [
                ("other", 1),
                (LONG_ID, 2),
            ]
            # A third failure of a failed source still counts; raising the budget un-fails it.
            assert client.set_max_attempts("fb/run", 5) == 0
            assert client.set_max_attempts("fb/run", 2) == 1
            with client.writer("fb/run") as w:
                w.apply_deltas(tree(LONG_ID))
                w.flush()
                # Completed: its failures are gone, and a failure of it is refused.
                with pytest.raises(tally.FailedPrecondition, match="completed"):
                    w.report_failure(LONG_ID, "late")
            assert [f.source_id for f in client.failures("fb/run")] == ["other"]
            assert client.checkpoint("fb/run").failed_sources == 0
            with client.writer("fb/run") as w:
                w.report_failure("other", "twice")
            assert client.checkpoint("fb/run").failed_sources == 1
            assert client.retry_failed("fb/run", []) == 0  # none named: nothing cleared
            assert client.retry_failed("fb/run", ["other"]) == 1
            assert list(client.failures("fb/run")) == []
            assert client.checkpoint("fb/run").failed_sources == 0


def test_the_cli_lists_and_retries_failed_sources_in_a_pipe(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", settle_ms=0) as server:
        with tally.Client(server.grpc_url) as client, client.writer("fb/cli", max_attempts=1) as w:
            w.report_failure(LONG_ID, "disk full\nwhile writing")
            w.report_failure("b", "bad row")
        address = server.grpc_url
        listed = cli(address, "failed", "fb/cli")
        assert listed.returncode == 0, listed.stderr
        assert LONG_ID in listed.stdout  # whole in a pipe
        assert "disk full while writing" in listed.stdout
        assert "2 failed sources in fb/cli (max attempts 1)" in listed.stdout
        status = cli(address, "status", "fb/cli")
        assert status.returncode == 0, status.stderr
        rows = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines() if line.strip()}
        assert rows["failed"][0] == "2" and rows["max"] == ["attempts", "1"]

        refused = cli(address, "retry", "fb/cli")  # every source, no terminal, no --yes
        assert refused.returncode == 1 and "--yes" in refused.stderr
        one = cli(address, "retry", "fb/cli", "b")
        assert (
            one.returncode == 0
            and "cleared the failed attempts of 1 source of fb/cli; it runs again" in one.stdout
        )
        rest = cli(address, "retry", "fb/cli", "--yes")
        assert rest.returncode == 0 and "of 1 source of fb/cli" in rest.stdout
        assert "no failed sources in fb/cli" in cli(address, "failed", "fb/cli").stdout


def test_the_http_wire_lists_many_named_sources_in_url_sized_calls(tmp_path: Path) -> None:
    """ListFailures names its sources in the URL over HTTP: the SDK keeps each call's URL small
    enough for the coordinator's HTTP server, however many ids it is asked about."""
    ids = [f"{LONG_ID}-{i:05d}" for i in range(1500)]  # ~250 KB of ids
    with running_server(tmp_path / "data", settle_ms=0) as server:
        with tally.Client(server.http_url) as client, client.writer("fb/http", max_attempts=1) as w:
            report = w.report_failure(ids[1234], "x")
            assert (report.attempts, report.failed, report.max_attempts) == (1, True, 1)
            found = list(client.failures("fb/http", source_ids=ids, failed_only=True))
            assert [f.source_id for f in found] == [ids[1234]]
            status = client.checkpoint("fb/http")
            assert (status.failed_sources, status.max_attempts) == (1, 1)
            assert client.retry_failed("fb/http") == 1
            assert client.set_max_attempts("fb/http", 0) == 0
