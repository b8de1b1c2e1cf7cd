"""gRPC transports over a real channel to a small in-process servicer (no grpc mocking).

The servicer is a canned stand-in for the coordinator: it checks that requests are encoded as the
proto says, and answers with fixed values or status codes so that conversion and the status
mapping table are exercised end to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2
from grpc_status import rpc_status

import tally
from tally import _calls as calls
from tally._transport.contact import NeverReached
from tally._transport.grpc import DETAILS_METADATA_KEY, AsyncGrpcTransport, GrpcTransport
from tally._types import WriterSpec
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tests.polling import wait_until
from tests.unit.client.dropping_listener import dropping_listener

SPEC = WriterSpec("cp/a", "w1", {"pipeline": "h1"}, {"team": "x"}, "host1", 42)


class Servicer(pb_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.requests: list[tuple[str, Any, dict[str, str]]] = []

    def _record(self, name: str, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append((name, request, {k: str(v) for k, v in context.invocation_metadata()}))

    def OpenWriter(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("OpenWriter", request, context)
        if request.writer_id == "live":
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "writer 'live' is live; pick another writer_id")
        return pb.OpenWriterResponse(
            handle="h1", writer_id=request.writer_id, lease_ttl_s=9.0, completed_count=4, settle_ms=250
        )

    def KeepAlive(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("KeepAlive", request, context)
        if request.handle == "gone":
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown writer handle")
        return pb.KeepAliveResponse(lease_ttl_s=9.0)

    def ApplyDeltas(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ApplyDeltas", request, context)
        if any(not d.task_id for d in request.deltas):
            context.set_trailing_metadata(((DETAILS_METADATA_KEY, json.dumps({"field": "task_id"})),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "deltas[0].task_id is empty")
        counts = pb.ApplyCounts(applied=len(request.deltas), completed=1)
        return pb.ApplyDeltasResponse(counts=counts, settled=request.batch_seq == 3)

    def AreCompleted(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("AreCompleted", request, context)
        if request.checkpoint == "busy":
            context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        return pb.AreCompletedResponse(completed=[s.startswith("done") for s in request.source_ids])

    def Flush(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("Flush", request, context)
        return pb.FlushResponse(completed=7)

    def CloseWriter(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("CloseWriter", request, context)
        return pb.CloseWriterResponse(
            counts=pb.ApplyCounts(applied=3, skipped=1), incomplete_sources=["s1", "s2"], incomplete_count=5
        )

    def GetCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("GetCheckpoint", request, context)
        if request.name == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "checkpoint 'missing' does not exist")
        if request.name == "denied":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "role reader cannot do this")
        if request.name == "moving":  # a coordinator's own refusal, as Tally sends one: with its Status
            status = status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="shard 2 is moving")
            context.abort_with_status(rpc_status.to_status(status))
        return checkpoint_pb(request.name)

    def ListCheckpoints(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ListCheckpoints", request, context)
        return pb.ListCheckpointsResponse(checkpoints=[checkpoint_pb("a"), checkpoint_pb("b/c")])

    def ListWriters(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ListWriters", request, context)
        closed = pb.WriterStatus(
            writer_id="old", state="closed", closed_at=12.5, labels={"slurm_job_id": "9"}
        )
        writers = [checkpoint_pb("x").writers[0]] + ([closed] if request.include_closed else [])
        return pb.ListWritersResponse(writers=writers[: request.limit])

    def ListEvents(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ListEvents", request, context)
        events = [
            pb.Event(
                id=5,
                checkpoint=request.checkpoint,
                kind="anomaly",
                message="late delta",
                at=3.5,
                writer_id="w1",
                data_json=json.dumps({"task_id": "t", "old": 1, "new": -1}),
                severity="warning",
            ),
            pb.Event(id=4, checkpoint=request.checkpoint, kind="writer_opened", data_json=""),
        ]
        return pb.ListEventsResponse(events=events, next_before_id=4 if request.before_id == 0 else 0)

    def GetProgress(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("GetProgress", request, context)
        return pb.GetProgressResponse(
            samples=[
                pb.ProgressSample(at=request.since + 1, completed_count=2),
                pb.ProgressSample(at=9, completed_count=4),
            ]
        )

    def WatchCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("WatchCheckpoint", request, context)
        if request.checkpoint == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "checkpoint 'missing' does not exist")
        for n in range(3):
            status = checkpoint_pb(request.checkpoint)
            status.completed_count = n
            yield status
        if request.checkpoint == "breaks":
            context.abort(grpc.StatusCode.UNAVAILABLE, "server shutting down")

    def ListCompleted(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ListCompleted", request, context)
        ids = [s for s in ("a", "b", "c") if s > request.after][: request.limit]
        return pb.ListCompletedResponse(source_ids=ids, next_after=ids[-1] if ids and ids[-1] != "c" else "")

    def ImportCompleted(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ImportCompleted", request, context)
        if request.import_id == "bad/id":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "import_id 'bad/id' may not contain '/'")
        return pb.ImportCompletedResponse(imported=len(request.source_ids), completed_count=10)

    def ResetCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("ResetCheckpoint", request, context)
        if not request.force:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "checkpoint has 1 live writer")
        return pb.ResetCheckpointResponse(moved_to=".trash/x/1", files_moved=3, writers_closed=1)

    def SaveCursors(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("SaveCursors", request, context)
        if any(len(c.data) > 4096 for c in request.cursors):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a cursor holds at most 4096 bytes")
        done = sum(c.source_id.startswith("done") for c in request.cursors)
        return pb.SaveCursorsResponse(saved=len(request.cursors) - done, completed=done)

    def GetCursor(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record("GetCursor", request, context)
        if request.source_id == "never":
            return pb.GetCursorResponse(found=False)
        return pb.GetCursorResponse(found=True, data=b"\x00row=7", saved_at=3.5, writer_id="w1")


def checkpoint_pb(name: str) -> Any:
    writer = pb.WriterStatus(
        writer_id="w1",
        host="host1",
        pid=42,
        labels={"team": "x"},
        state="live",
        pending_sources=2,
        counts=pb.ApplyCounts(applied=5, anomalies=1),
        opened_at=10.5,
        last_seen_at=11.5,
    )
    return pb.CheckpointStatus(
        name=name,
        completed_count=3,
        live_writers=1,
        pending_sources=2,
        settling_sources=1,
        anomalies=1,
        unreadable_files=0,
        created_at=1.0,
        last_activity_at=2.0,
        writers=[writer],
        fingerprint={"pipeline": "h1"},
    )


@pytest.fixture
def grpc_server() -> Iterator[tuple[str, Servicer]]:
    servicer = Servicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None).wait()


def test_requests_and_responses_convert_both_ways(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server
    transport = GrpcTransport(target, token="s3cret")
    try:
        opened = transport.send(calls.OpenWriter(SPEC), 5)
        assert (opened.handle, opened.writer_id, opened.lease_ttl_s, opened.completed_count) == (
            "h1",
            "w1",
            9.0,
            4,
        )
        assert opened.settle_ms == 250
        assert transport.send(calls.KeepAlive("h1"), 5) == 9.0
        counts = transport.send(calls.ApplyDeltas("h1", [("t1", "s1", 1), ("t2", "s1", -1)], 3), 5)
        assert counts == calls.BatchAnswer(tally.ApplyCounts(applied=2, completed=1), settled=True)
        assert transport.send(calls.AreCompleted("cp/a", ["done1", "x"]), 5) == [True, False]
        assert transport.send(calls.Flush("h1"), 5) == 7
        closed = transport.send(calls.CloseWriter("h1"), 5)
        assert closed == tally.CloseResult(tally.ApplyCounts(applied=3, skipped=1), ("s1", "s2"), 5)
        status = transport.send(calls.GetCheckpoint("cp/a"), 5)
        assert [c.name for c in transport.send(calls.ListCheckpoints(), 5).checkpoints] == ["a", "b/c"]
    finally:
        transport.close()

    assert status.name == "cp/a" and status.completed_count == 3 and status.settling_sources == 1
    assert status.fingerprint == {"pipeline": "h1"}
    (writer,) = status.writers
    assert writer == tally.WriterStatus(
        "w1", "host1", 42, {"team": "x"}, "live", 2, tally.ApplyCounts(applied=5, anomalies=1), 10.5, 11.5
    )
    name, open_req, metadata = servicer.requests[0]
    assert name == "OpenWriter" and metadata["authorization"] == "Bearer s3cret"
    assert (open_req.checkpoint, open_req.writer_id, open_req.host, open_req.pid) == (
        "cp/a",
        "w1",
        "host1",
        42,
    )
    assert dict(open_req.fingerprint) == {"pipeline": "h1"} and dict(open_req.labels) == {"team": "x"}
    apply_req = servicer.requests[2][1]
    assert apply_req.batch_seq == 3 and apply_req.handle == "h1"
    assert [(d.task_id, d.source_id, d.delta) for d in apply_req.deltas] == [
        ("t1", "s1", 1),
        ("t2", "s1", -1),
    ]


@pytest.mark.parametrize(
    ("call", "error", "code"),
    [
        (
            lambda t: t.send(calls.OpenWriter(WriterSpec("cp", "live", {}, {}, "h", 1)), 5),
            tally.AlreadyExists,
            "ALREADY_EXISTS",
        ),
        (lambda t: t.send(calls.KeepAlive("gone"), 5), tally.NotFound, "NOT_FOUND"),
        (
            lambda t: t.send(calls.ApplyDeltas("h1", [("", "s", 1)], 1), 5),
            tally.InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (lambda t: t.send(calls.AreCompleted("busy", ["a"]), 5), tally.Unavailable, "UNAVAILABLE"),
        (lambda t: t.send(calls.GetCheckpoint("missing"), 5), tally.NotFound, "NOT_FOUND"),
        (lambda t: t.send(calls.GetCheckpoint("denied"), 5), tally.PermissionDenied, "PERMISSION_DENIED"),
    ],
)
def test_status_codes_map_to_sdk_errors(
    grpc_server: tuple[str, Servicer], call: Any, error: type[tally.TallyError], code: str
) -> None:
    transport = GrpcTransport(grpc_server[0])
    try:
        with pytest.raises(error) as info:
            call(transport)
    finally:
        transport.close()
    assert type(info.value) is error and info.value.code == tally.StatusCode(code)


def test_error_message_and_details_survive(grpc_server: tuple[str, Servicer]) -> None:
    transport = GrpcTransport(grpc_server[0])
    try:
        with pytest.raises(tally.InvalidArgument) as info:
            transport.send(calls.ApplyDeltas("h1", [("", "s", 1)], 1), 5)
    finally:
        transport.close()
    assert info.value.message == "deltas[0].task_id is empty"
    assert info.value.details == {"field": "task_id"}
    assert info.value.__cause__ is None  # no grpc objects leak to users


def test_unreachable_coordinator_is_unavailable() -> None:
    transport = GrpcTransport("127.0.0.1:1")
    try:
        # Never reached: the error says nothing listens there; the transport's own names the target.
        with pytest.raises(
            NeverReached, match=r"no Tally coordinator is listening at 127\.0\.0\.1:1"
        ) as info:
            transport.send(calls.AreCompleted("cp", ["a"]), 2)
        assert isinstance(info.value, tally.Unavailable)
        assert "127.0.0.1:1 is unavailable" in info.value.refused.message
    finally:
        transport.close()


def test_a_coordinator_that_refused_a_call_itself_was_reached_and_a_refused_connection_is_retried() -> None:
    """A coordinator answering UNAVAILABLE on its own (a shard moving, an owner out of reach) is
    there: when its port then refuses connections (its service restarting, the process killed), that
    is an outage to retry, not "no coordinator listens here" (found by the sharded chaos run: writers
    of a cluster reshuffling gave up at once)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CoordinatorServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    transport = GrpcTransport(f"127.0.0.1:{port}")
    try:
        with pytest.raises(tally.Unavailable, match="shard 2 is moving") as answered:
            transport.send(calls.GetCheckpoint("moving"), 5)
        assert not isinstance(answered.value, NeverReached)
        server.stop(None).wait()
        with pytest.raises(tally.Unavailable, match="Connection refused") as refused:
            transport.send(calls.GetCheckpoint("moving"), 5)
        assert not isinstance(refused.value, NeverReached)
    finally:
        transport.close()
        server.stop(None)


def test_a_connection_that_broke_mid_call_was_reached_and_a_refused_connection_is_retried() -> None:
    """A coordinator killed while it answered a client's very first call (a writer opening during a
    restart) broke an open connection: something listened, so the refusals while it restarts are an
    outage to retry, not "no coordinator listens here" (found by bench/faults.py kill9)."""
    with dropping_listener() as (port, down):
        transport = GrpcTransport(f"127.0.0.1:{port}")
        try:
            with pytest.raises(tally.Unavailable) as broke:
                transport.send(calls.GetCheckpoint("c"), 5)
            assert not isinstance(broke.value, NeverReached)
            down()
            wait_until(lambda: _refused(transport), timeout=30, what="a refused connection")
        finally:
            transport.close()


def _refused(transport: GrpcTransport) -> bool:
    """Call once more: True once the port refused the connection (never as NeverReached)."""
    with pytest.raises(tally.Unavailable) as err:
        transport.send(calls.GetCheckpoint("c"), 5)
    assert not isinstance(err.value, NeverReached), err.value.message
    return "Connection refused" in err.value.message


def test_call_on_a_closed_channel_is_unavailable(grpc_server: tuple[str, Servicer]) -> None:
    transport = GrpcTransport(grpc_server[0])
    transport.close()
    with pytest.raises(tally.Unavailable, match="closed"):
        transport.send(calls.Flush("h1"), 5)


def test_async_transport_converts_and_maps_errors(grpc_server: tuple[str, Servicer]) -> None:
    async def main() -> None:
        transport = AsyncGrpcTransport(grpc_server[0], token="tok")
        try:
            opened = await transport.send(calls.OpenWriter(SPEC), 5)
            assert opened.handle == "h1"
            assert await transport.send(calls.KeepAlive("h1"), 5) == 9.0
            answer = await transport.send(calls.ApplyDeltas("h1", [("t", "s", 1)], 1), 5)
            assert answer == calls.BatchAnswer(tally.ApplyCounts(1, 0, 0, 0, 1), settled=False)
            assert await transport.send(calls.AreCompleted("cp", ["done", "no"]), 5) == [True, False]
            assert await transport.send(calls.Flush("h1"), 5) == 7
            assert (await transport.send(calls.CloseWriter("h1"), 5)).incomplete_count == 5
            assert (await transport.send(calls.GetCheckpoint("x"), 5)).name == "x"
            assert len((await transport.send(calls.ListCheckpoints(), 5)).checkpoints) == 2
            with pytest.raises(tally.NotFound, match="does not exist"):
                await transport.send(calls.GetCheckpoint("missing"), 5)
        finally:
            await transport.close()

    asyncio.run(main())
    assert grpc_server[1].requests[0][2]["authorization"] == "Bearer tok"


def test_sync_client_end_to_end_over_grpc(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server
    with tally.Client(f"grpc://{target}", token="t") as client:
        with client.writer("cp/a", writer_id="w1") as w:
            w.apply_deltas([("t1", "s1", 1), ("t2", "s1", -1)])
            w.flush()
            assert w.are_completed(["done-1"]) == [True]
        assert client.checkpoint("cp/a").completed_count == 3
    names = [name for name, _, _ in servicer.requests]
    assert names[0] == "OpenWriter" and names[-1] == "GetCheckpoint"
    assert names.index("ApplyDeltas") < names.index("Flush") < names.index("CloseWriter")


def test_async_client_end_to_end_over_grpc(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server

    async def main() -> None:
        async with tally.AsyncClient(target) as client:
            async with client.writer("cp/a", writer_id="w1") as w:
                w.apply_deltas([("t1", "s1", 1)])
                await w.flush()
            assert [c.name for c in await client.checkpoints()] == ["a", "b/c"]

    asyncio.run(main())
    names = [name for name, _, _ in servicer.requests]
    assert names.index("ApplyDeltas") < names.index("Flush") < names.index("CloseWriter")


def test_status_rpcs_convert_both_ways(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server
    transport = GrpcTransport(target)
    try:
        (live,) = transport.send(calls.ListWriters("cp", False, 10), 5).writers
        assert live.writer_id == "w1" and live.closed_at == 0.0
        live_and_closed = transport.send(calls.ListWriters("cp", True, 10), 5).writers
        assert live_and_closed[1] == tally.WriterStatus(
            "old", "", 0, {"slurm_job_id": "9"}, "closed", 0, tally.ApplyCounts(), 0.0, 0.0, 12.5
        )
        page = transport.send(calls.ListEvents("cp", 2, None), 5)
        assert page.next_before_id == 4
        assert page.events[0] == tally.Event(
            5,
            "cp",
            "anomaly",
            "late delta",
            3.5,
            "w1",
            {"task_id": "t", "old": 1, "new": -1},
            tally.Severity.WARNING,
        )
        assert page.events[1].data == {}
        assert page.events[1].severity == tally.Severity.INFO  # not sent (an older server): info
        assert transport.send(calls.ListEvents("cp", 2, 4), 5).next_before_id is None
        assert transport.send(calls.GetProgress("cp", 5.0), 5) == [
            tally.ProgressSample(6.0, 2),
            tally.ProgressSample(9.0, 4),
        ]
        first = transport.send(calls.ListCompleted("cp", "", 2), 5)
        assert (first.source_ids, first.next_after) == (("a", "b"), "b")
        last = transport.send(calls.ListCompleted("cp", "b", 2), 5)
        assert (last.source_ids, last.next_after) == (("c",), "")
        assert transport.send(calls.ImportCompleted("cp", ["x", "y"], "imp-1"), 5) == tally.ImportResult(
            2, 10
        )
        assert transport.send(calls.ResetCheckpoint("cp", True), 5) == tally.ResetResult(".trash/x/1", 3, 1)
        with pytest.raises(tally.FailedPrecondition, match="1 live writer"):
            transport.send(calls.ResetCheckpoint("cp", False), 5)
        with pytest.raises(tally.InvalidArgument, match="may not contain"):
            transport.send(calls.ImportCompleted("cp", ["x"], "bad/id"), 5)
    finally:
        transport.close()
    requests = {name: req for name, req, _ in servicer.requests}
    assert (requests["ListWriters"].checkpoint, requests["ListWriters"].include_closed) == ("cp", True)
    assert (requests["ListEvents"].limit, requests["ListEvents"].before_id) == (2, 4)
    assert requests["GetProgress"].since == 5.0
    assert (requests["ListCompleted"].after, requests["ListCompleted"].limit) == ("b", 2)
    assert list(requests["ImportCompleted"].source_ids) == ["x"]
    assert (requests["ResetCheckpoint"].name, requests["ResetCheckpoint"].force) == ("cp", False)


def test_watch_streams_and_maps_errors(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server
    transport = GrpcTransport(target, token="tok")
    try:
        assert [s.completed_count for s in transport.watch(calls.WatchCheckpoint("cp", 250), 5)] == [0, 1, 2]
        stream = transport.watch(calls.WatchCheckpoint("breaks", 250), 5)
        assert next(stream).name == "breaks"
        with pytest.raises(tally.Unavailable, match="shutting down"):
            list(stream)
        with pytest.raises(tally.NotFound, match="does not exist"):
            next(transport.watch(calls.WatchCheckpoint("missing", 250), 5))
        early = transport.watch(calls.WatchCheckpoint("cp", 250), 5)
        next(early)
        early.close()  # cancels the call
    finally:
        transport.close()
    name, request, metadata = servicer.requests[0]
    assert (
        name == "WatchCheckpoint" and request.interval_ms == 250 and metadata["authorization"] == "Bearer tok"
    )


def test_async_status_rpcs_and_watch(grpc_server: tuple[str, Servicer]) -> None:
    async def main() -> None:
        transport = AsyncGrpcTransport(grpc_server[0])
        try:
            assert len((await transport.send(calls.ListWriters("cp", True, 10), 5)).writers) == 2
            assert (await transport.send(calls.ListEvents("cp", 2, None), 5)).events[0].data["old"] == 1
            assert len(await transport.send(calls.GetProgress("cp", None), 5)) == 2
            assert (await transport.send(calls.ListCompleted("cp", "", 5), 5)).source_ids == ("a", "b", "c")
            assert (await transport.send(calls.ImportCompleted("cp", ["x"], "i"), 5)).imported == 1
            assert (await transport.send(calls.ResetCheckpoint("cp", True), 5)).files_moved == 3
            assert [
                s.completed_count async for s in transport.watch(calls.WatchCheckpoint("cp", 100), 5)
            ] == [0, 1, 2]
            with pytest.raises(tally.NotFound):
                async for _ in transport.watch(calls.WatchCheckpoint("missing", 100), 5):
                    pass
            with pytest.raises(tally.Unavailable, match="shutting down"):
                async for _ in transport.watch(calls.WatchCheckpoint("breaks", 100), 5):
                    pass
        finally:
            await transport.close()

    asyncio.run(main())


def test_client_status_methods_over_grpc(grpc_server: tuple[str, Servicer]) -> None:
    with tally.Client(grpc_server[0]) as client:
        assert list(client.completed("cp", page_size=2)) == ["a", "b", "c"]
        stream = client.watch("cp", interval_s=0.5)
        assert [next(stream).completed_count for _ in range(4)] == [0, 1, 2, 0]  # reconnected once
        stream.close()  # type: ignore[attr-defined]


def test_cursor_rpcs_convert_both_ways(grpc_server: tuple[str, Servicer]) -> None:
    target, servicer = grpc_server
    transport = GrpcTransport(target)
    try:
        saved = transport.send(calls.SaveCursors("h1", [("a", b"\x00\x01"), ("done-1", b"")], "w1"), 5)
        assert saved == calls.CursorsSaved(saved=1, completed=1)
        with pytest.raises(tally.InvalidArgument, match="4096"):
            transport.send(calls.SaveCursors("h1", [("a", bytes(4097))]), 5)
        found = transport.send(calls.GetCursor("cp", "a"), 5)
        assert found == calls.SavedCursor(b"\x00row=7", 3.5, "w1")
        assert transport.send(calls.GetCursor("cp", "never"), 5) is None
    finally:
        transport.close()
    requests = [(name, req) for name, req, _ in servicer.requests]
    save = requests[0][1]
    assert save.handle == "h1" and [(c.source_id, c.data) for c in save.cursors] == [
        ("a", b"\x00\x01"),
        ("done-1", b""),
    ]
    assert (requests[2][1].checkpoint, requests[2][1].source_id) == ("cp", "a")
