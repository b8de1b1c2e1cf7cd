"""The same scenario over gRPC and over HTTP must end in the same state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import nemo_read, tree


def scenario(address: str) -> dict[str, Any]:
    """Two writers, retries, a rewrite, a filtered tree, an anomaly and an unfinished source."""
    checkpoint = "congruence/run"
    with tally.Client(address) as client:
        with client.writer(checkpoint, writer_id="task-0", labels={"array_task": "0"}) as w0:
            w0.apply_deltas(tree("a") + tree("b"))
            w0.apply_deltas(tree("a"))  # retried tasks: all skipped
            w0.apply_deltas([("0_c", "c", 1), ("0_c_0", "c", 2)])
            w0.apply_deltas([("0_c_0", "c", 0), ("0_c_0_0", "c", -1)])  # rewrite, then the sink
            w0.apply_deltas([("0_d", "d", 1)])  # never finishes
        closed0 = w0.close()
        with client.writer(checkpoint, writer_id="task-1") as w1:
            before = w1.are_completed(["a", "b", "c", "d", "e"])
            w1.apply_deltas(tree("e"))
            w1.apply_deltas([("0_a_9", "a", -1)])  # a late delta for a completed source: anomaly
            w1.flush()
            status = client.checkpoint(checkpoint)
        closed1 = w1.close()
        after = client.are_completed(checkpoint, ["a", "b", "c", "d", "e"])
        final = client.checkpoint(checkpoint)
    return {
        "before": before,
        "after": after,
        "closed0": (closed0.counts, closed0.incomplete_sources),
        "closed1": (closed1.counts, closed1.incomplete_sources),
        "live": (status.completed_count, status.live_writers, status.anomalies, status.pending_sources),
        "final": (final.completed_count, final.live_writers, final.anomalies, final.pending_sources),
    }


def test_grpc_and_http_end_in_the_same_state(tmp_path: Path) -> None:
    results = {}
    files = {}
    for transport in ("grpc", "http"):
        data = tmp_path / transport
        with running_server(data, settle_ms=0) as server:
            address = server.grpc_address if transport == "grpc" else server.http_url
            results[transport] = scenario(f"{transport}://{address.removeprefix('http://')}")
        files[transport] = nemo_read(data / "checkpoints" / "congruence" / "run")
    assert results["grpc"] == results["http"]
    assert files["grpc"] == files["http"] == {"b", "c", "e"}
    assert results["grpc"]["before"] == [True, True, True, False, False]
    assert results["grpc"]["closed0"][1] == ("d",)
    assert results["grpc"]["final"] == (3, 0, 1, 0)


def test_http_transport_reports_server_refusals(server: RunningServer) -> None:
    with tally.Client(server.http_url) as client:
        try:
            client.are_completed("../escape", ["a"])
        except tally.InvalidArgument as exc:
            assert "checkpoint name" in str(exc)
        else:
            raise AssertionError("an escaping checkpoint name was accepted over HTTP")
