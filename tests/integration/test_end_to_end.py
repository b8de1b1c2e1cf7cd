"""The real SDK against a real ``tally serve`` process: the scenarios of the core issue."""

from __future__ import annotations

from pathlib import Path

import grpc

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.conftest import load_trace
from tests.integration.workload import nemo_read, tree


def test_fan_out_filter_and_sink_complete_each_source_exactly_once(server: RunningServer) -> None:
    sources = [f"src{i}" for i in range(5)]
    with tally.Client(server.grpc_address) as client:
        with client.writer("e2e/tree", writer_id="host-1") as w:
            assert w.are_completed(sources) == [False] * 5
            for sid in sources[:4]:
                w.apply_deltas(tree(sid))
            w.apply_deltas(tree("src4")[:-1])  # src4's last sink never reports
            w.flush()
            assert w.are_completed(sources) == [True, True, True, True, False]
            status = client.checkpoint("e2e/tree")
            assert status.completed_count == 4
            assert status.pending_sources == 1
            assert status.live_writers == 1
        result = w.close()
        assert result.incomplete_sources == ("src4",)
        assert result.counts.completed == 4
        assert result.counts.anomalies == 0
    assert nemo_read(server.data_dir / "checkpoints" / "e2e" / "tree") == set(sources[:4])


def test_retries_are_skipped_and_rewrites_replace_the_old_delta(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client, client.writer("e2e/retry", writer_id="w") as w:
        w.apply_deltas([("0_a", "a", 1), ("0_a_0", "a", 2)])
        w.apply_deltas([("0_a", "a", 1), ("0_a_0", "a", 2)])  # a Ray retry of the same tasks
        w.apply_deltas([("0_a_0", "a", 0)])  # the retry produced one child instead of three
        w.apply_deltas([("0_a_0_0", "a", -1)])
        w.flush()
        assert w.are_completed(["a"]) == [True]
        result = w.close()
    assert (result.counts.applied, result.counts.skipped, result.counts.rewritten) == (3, 2, 1)
    assert result.counts.completed == 1


def test_two_writers_see_each_others_completions_live(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        with (
            client.writer("e2e/shared", writer_id="task-0") as w0,
            client.writer("e2e/shared", writer_id="task-1") as w1,
        ):
            w0.apply_deltas(tree("x"))
            w0.flush()
            # w1 opened before x completed and still sees it at once, and so does a plain client.
            assert w1.are_completed(["x", "y"]) == [True, False]
            assert client.are_completed("e2e/shared", ["x"]) == [True]
            # Overlap: w1 also processes x. Not an anomaly for w1, which opened before x completed.
            w1.apply_deltas(tree("x"))
            w1.apply_deltas(tree("y"))
            w1.flush()
            assert w0.are_completed(["y"]) == [True]
            status = client.checkpoint("e2e/shared")
            assert status.anomalies == 0
            assert {ws.writer_id for ws in status.writers} == {"task-0", "task-1"}
    assert nemo_read(server.data_dir / "checkpoints" / "e2e" / "shared") == {"x", "y"}


def test_anomaly_uncompletes_in_every_writer_file(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        with client.writer("e2e/anomaly", writer_id="first") as w:
            w.apply_deltas(tree("a"))
        with client.writer("e2e/anomaly", writer_id="second") as w:
            w.apply_deltas(tree("a"))  # a was completed before this writer opened: anomaly
            w.flush()
            assert client.are_completed("e2e/anomaly", ["a"]) == [False]
            assert client.checkpoint("e2e/anomaly").anomalies >= 1
    assert nemo_read(server.data_dir / "checkpoints" / "e2e" / "anomaly") == set()


def test_a_rerun_over_completed_sources_counts_every_anomaly_in_a_few_events(server: RunningServer) -> None:
    """A resume that does not skip what is done makes an anomaly of every source.

    Each is counted and un-completed everywhere, but a batch's anomalies past its first 20 are one
    event: an event (a log line and a registry row) per anomaly held the coordinator's loop up for
    seconds and flooded the event log.
    """
    sources = [f"rerun{i:03d}" for i in range(150)]
    deltas = [d for sid in sources for d in tree(sid)]
    with tally.Client(server.grpc_address) as client:
        with client.writer("e2e/rerun", writer_id="first") as w:
            w.apply_deltas(deltas)
        assert client.are_completed("e2e/rerun", sources) == [True] * 150
        with client.writer("e2e/rerun", writer_id="again") as w:
            w.apply_deltas(deltas)
            w.flush()
        assert w.close().counts.anomalies == 150
        assert client.are_completed("e2e/rerun", sources) == [False] * 150
        assert client.checkpoint("e2e/rerun").anomalies == 150
        events = [e for e in client.events("e2e/rerun", limit=1000).events if e.kind == "anomaly"]
    one_each = [e.data["source_id"] for e in events if "source_id" in e.data]
    summaries = [e for e in events if "more" in e.data]
    assert summaries and len(events) < 150
    assert len(one_each) + sum(e.data["more"] for e in summaries) == 150
    assert all(e.severity == tally.Severity.WARNING and e.writer_id == "again" for e in events)
    assert all("more source" in e.message and e.data["first_source_id"] in e.message for e in summaries)
    assert nemo_read(server.data_dir / "checkpoints" / "e2e" / "rerun") == set()


def test_a_restart_keeps_completed_and_pending_and_the_writer_carries_on(tmp_path: Path) -> None:
    """Issue 9: a coordinator restart is invisible to a writer except as a pause."""
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as first:
        ports = {"grpc_listen": first.grpc_address, "http_listen": first.http_address}
        client = tally.Client(first.grpc_address)
        w = client.writer("e2e/restart", writer_id="long-job")
        w.open()
        w.apply_deltas(tree("done"))
        w.apply_deltas(tree("half")[:3])
        w.flush()
        assert first.terminate() == 0
    # Same ports, so the still-running writer reaches the restarted coordinator.
    with running_server(data, settle_ms=0, **ports) as second:
        with tally.Client(second.grpc_address) as fresh:
            assert fresh.are_completed("e2e/restart", ["done", "half"]) == [True, False]
            status = fresh.checkpoint("e2e/restart")
            # The writer is back, with its pending source: nothing was dropped.
            assert (status.completed_count, status.pending_sources, status.live_writers) == (1, 1, 1)
        w.apply_deltas(tree("half")[3:])
        w.flush()
        assert not w.health().lease_lost
        closed = w.close()
        assert closed.incomplete_count == 0
        client.close()
        with tally.Client(second.grpc_address) as fresh:
            assert fresh.are_completed("e2e/restart", ["half"]) == [True]
            kinds = [e.kind for e in fresh.events("e2e/restart", limit=50).events]
            assert "writer_restored" in kinds and "writer_lost" not in kinds


def test_settle_window_never_shows_an_out_of_order_completion_early(tmp_path: Path) -> None:
    # Raw stubs: each ApplyDeltas returns once applied, so no timing is involved before the flush.
    with (
        running_server(tmp_path / "data", settle_ms=2000) as server,
        grpc.insecure_channel(server.grpc_address) as channel,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="e2e/settle", writer_id="w")).handle

        def send(*deltas: tuple[str, str, int]) -> None:
            batch = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in deltas]
            stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=batch))

        def visible() -> bool:
            reply = stub.AreCompleted(pb.AreCompletedRequest(checkpoint="e2e/settle", source_ids=["s"]))
            return bool(reply.completed[0])

        # The sink of child 0 arrives before the parent's fan-out (+2): the count touches zero.
        send(("0_s", "s", 1))
        send(("0_s_0_0", "s", -1))
        assert not visible()
        assert stub.GetCheckpoint(pb.GetCheckpointRequest(name="e2e/settle")).settling_sources == 1
        send(("0_s_0", "s", 2))  # cancels the settle: the zero was false
        assert not visible()
        send(("0_s_0_1", "s", -1), ("0_s_0_2", "s", -1))
        assert not visible()
        stub.Flush(pb.FlushRequest(handle=handle))  # waits out the window: now s is complete
        assert visible()
        status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="e2e/settle"))
        assert (status.anomalies, status.completed_count) == (0, 1)


def test_without_a_settle_window_the_same_stream_completes_falsely(server: RunningServer) -> None:
    """The contrast that shows the test above can fail: settle_ms=0 is NeMo's early completion."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="e2e/early", writer_id="w")).handle
        for task, delta in [("0_s", 1), ("0_s_0_0", -1)]:
            stub.ApplyDeltas(
                pb.ApplyDeltasRequest(
                    handle=handle, deltas=[pb.Delta(task_id=task, source_id="s", delta=delta)]
                )
            )
        reply = stub.AreCompleted(pb.AreCompletedRequest(checkpoint="e2e/early", source_ids=["s"]))
        assert list(reply.completed) == [True]
        counts = stub.ApplyDeltas(
            pb.ApplyDeltasRequest(handle=handle, deltas=[pb.Delta(task_id="0_s_0", source_id="s", delta=2)])
        ).counts
        assert counts.anomalies == 1


def test_nemo_trace_replayed_call_by_call_completes_what_it_records(server: RunningServer) -> None:
    checkpoint = "nemo/trace"
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=checkpoint, writer_id="nemo-host-1")).handle
        completed: set[str] = set()
        for row in load_trace():
            if row["method"] == "are_completed":
                reply = stub.AreCompleted(
                    pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=row["source_ids"])
                )
                assert list(reply.completed) == row["result"], row["seq"]
            elif row["method"] == "apply_deltas":
                batch = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in row["per_task"]]
                counts = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=batch)).counts
                assert counts.completed == len(row["newly_completed"]), row["seq"]
                completed |= set(row["newly_completed"])
                ids = sorted(completed)
                reply = stub.AreCompleted(pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=ids))
                assert all(reply.completed), row["seq"]
            elif row["method"] == "close":
                closed = stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
                assert closed.incomplete_count == len(row["pending"])
                assert sorted(completed) == sorted(row["completed"])
    assert nemo_read(server.data_dir / "checkpoints" / "nemo" / "trace") == set(row["completed"])
