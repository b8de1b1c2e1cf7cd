"""The fingerprint guard (DESIGN §2.5): no resuming a checkpoint with different inputs by accident."""

from __future__ import annotations

from pathlib import Path

import pytest

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree

FIRST = {"pipeline": "p-1", "input": "in-1"}


def addresses(server: RunningServer) -> list[str]:
    return [server.grpc_address, server.http_url]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_different_fingerprint_is_refused_naming_each_component(
    server: RunningServer, transport: str
) -> None:
    address = server.grpc_address if transport == "grpc" else server.http_url
    checkpoint = f"fp/{transport}"
    with tally.Client(address) as client:
        with client.writer(checkpoint, writer_id="first", fingerprint=FIRST) as w:
            w.apply_deltas(tree("a"))
        with pytest.raises(tally.FailedPrecondition) as refused:
            client.writer(
                checkpoint, writer_id="second", fingerprint={"pipeline": "p-1", "input": "in-2"}
            ).open()
        message = str(refused.value)
        assert "input: recorded 'in-1', this writer 'in-2'" in message
        assert "pipeline" not in message.split("fingerprint:")[1].split(".")[0]  # only what differs
        assert "on_mismatch='reset'" in message
        # Refused means nothing changed: no writer, the completion is still there.
        status = client.checkpoint(checkpoint)
        assert (status.live_writers, status.completed_count) == (0, 1)
        assert status.fingerprint == FIRST
        # The same fingerprint resumes; no fingerprint at all is not checked (NeMo Curator sends none).
        with client.writer(checkpoint, writer_id="same", fingerprint=dict(FIRST)) as w:
            assert w.are_completed(["a"]) == [True]
        client.writer(checkpoint, writer_id="none").open()


def test_ignore_lets_the_writer_in_and_records_it(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        with client.writer("fp/ignore", writer_id="first", fingerprint=FIRST) as w:
            w.apply_deltas(tree("a"))
        changed = {"pipeline": "p-2", "input": "in-1"}
        with client.writer("fp/ignore", writer_id="second", fingerprint=changed, on_mismatch="ignore") as w:
            assert w.are_completed(["a"]) == [True]
        assert client.checkpoint("fp/ignore").fingerprint == FIRST
        kinds = [e.kind for e in client.events("fp/ignore").events]
        assert "fingerprint_mismatch_ignored" in kinds


def test_reset_starts_over_but_not_while_others_are_live(tmp_path: Path) -> None:
    data = tmp_path / "data"
    changed = {"pipeline": "p-1", "input": "in-2"}
    with running_server(data, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        live = client.writer("fp/reset", writer_id="first", fingerprint=FIRST)
        live.open()
        live.apply_deltas(tree("a"))
        live.flush()
        with pytest.raises(tally.FailedPrecondition, match=r"has 1 live writer \(first\); stop it first"):
            client.writer("fp/reset", writer_id="second", fingerprint=changed, on_mismatch="reset").open()
        live.close()
        with client.writer("fp/reset", writer_id="second", fingerprint=changed, on_mismatch="reset") as w:
            assert w.are_completed(["a"]) == [False]  # started over
            w.apply_deltas(tree("b"))
        assert client.checkpoint("fp/reset").fingerprint == changed
        assert (data / ".trash" / "fp" / "reset").is_dir()
        # Now the old inputs are the different ones.
        with pytest.raises(tally.FailedPrecondition, match="recorded 'in-2', this writer 'in-1'"):
            client.writer("fp/reset", writer_id="third", fingerprint=FIRST).open()


def test_the_recorded_fingerprint_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        with client.writer("fp/restart", writer_id="w", fingerprint=FIRST) as w:
            w.apply_deltas(tree("a"))
    with running_server(data, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        with pytest.raises(tally.FailedPrecondition, match="recorded 'p-1', this writer 'p-9'"):
            client.writer("fp/restart", writer_id="w", fingerprint={**FIRST, "pipeline": "p-9"}).open()


def test_on_mismatch_is_checked_client_side() -> None:
    with tally.Client("127.0.0.1:1") as client, pytest.raises(tally.InvalidArgument, match="on_mismatch"):
        client.writer("fp/x", on_mismatch="overwrite")
