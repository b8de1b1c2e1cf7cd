"""gRPC wire <-> public types: the only module that touches protobuf messages.

:data:`ROUTES` maps each call description to the RPC that carries it, how to build its request
and how to read its reply. Replies are read field by field from typed messages; proto3 fills a
field a server does not send with its zero value, so a newer or older server still reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Generic, TypeVar, cast

import grpc

from tally import _calls as calls
from tally._calls import Call
from tally._types import (
    ApplyCounts,
    CheckpointPage,
    CheckpointStatus,
    Claim,
    CloseResult,
    CompletedPage,
    Event,
    EventPage,
    FailedAttempt,
    FailurePage,
    FailureReport,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    Replica,
    Replicas,
    ResetResult,
    Severity,
    SourceFailures,
    WriterPage,
    WriterSpec,
    WriterStatus,
)
from tally.v1 import coordinator_pb2 as pb
from tally.v1.coordinator_pb2_grpc import CoordinatorStub

C = TypeVar("C", bound=Call[Any])
Req = TypeVar("Req")
Reply = TypeVar("Reply")
T = TypeVar("T")


@dataclass(frozen=True)
class Route(Generic[C, Req, Reply, T]):
    """How one call description travels over gRPC.

    ``rpc`` picks the stub's bound method. On a ``grpc.aio`` channel the same attribute of the
    same stub class is the awaitable flavour (mypy-protobuf types it on ``CoordinatorAsyncStub``).
    """

    rpc: Callable[[CoordinatorStub], grpc.UnaryUnaryMultiCallable[Req, Reply]]
    request: Callable[[C], Req]
    read: Callable[[Reply], T]


def route(call: Call[T]) -> Route[Call[T], Any, Any, T]:
    """The route of ``call``'s operation."""
    return cast("Route[Call[T], Any, Any, T]", ROUTES[type(call)])


# --------------------------------------------------------------------------- requests

_ON_MISMATCH_PB = {
    "refuse": pb.ON_MISMATCH_REFUSE,
    "reset": pb.ON_MISMATCH_RESET,
    "ignore": pb.ON_MISMATCH_IGNORE,
}


def open_writer_request(spec: WriterSpec) -> pb.OpenWriterRequest:
    return pb.OpenWriterRequest(
        checkpoint=spec.checkpoint,
        writer_id=spec.writer_id,
        fingerprint=dict(spec.fingerprint),
        labels=dict(spec.labels),
        host=spec.host,
        pid=spec.pid,
        on_mismatch=_ON_MISMATCH_PB[spec.on_mismatch],
        session_token=spec.session_token,
    )


_TASK_ID, _SOURCE_ID, _DELTA = itemgetter(0), itemgetter(1), itemgetter(2)


def apply_deltas_request(call: calls.ApplyDeltas) -> pb.ApplyDeltasRequest:
    if call.columns and call.deltas:
        # Three parallel columns: no message object per delta, on either side. Filled in place:
        # a DeltaColumns built apart would be copied whole into the request.
        request = pb.ApplyDeltasRequest(handle=call.handle, batch_seq=call.batch_seq, ordered=call.ordered)
        columns = request.columns
        columns.task_ids.extend(map(_TASK_ID, call.deltas))
        columns.source_ids.extend(map(_SOURCE_ID, call.deltas))
        columns.deltas.extend(map(_DELTA, call.deltas))
        return request
    return pb.ApplyDeltasRequest(
        handle=call.handle,
        deltas=[pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in call.deltas],
        batch_seq=call.batch_seq,
        ordered=call.ordered,
    )


# --------------------------------------------------------------------------- replies


def opened_from_pb(msg: pb.OpenWriterResponse) -> OpenedWriter:
    return OpenedWriter(
        handle=msg.handle,
        writer_id=msg.writer_id,
        lease_ttl_s=msg.lease_ttl_s,
        completed_count=msg.completed_count,
        settle_ms=msg.settle_ms,
        delta_columns=msg.accepts_delta_columns,
        max_batches_in_flight=max(1, msg.max_batches_in_flight),
    )


def counts_from_pb(msg: pb.ApplyCounts) -> ApplyCounts:
    return ApplyCounts(
        applied=msg.applied,
        skipped=msg.skipped,
        rewritten=msg.rewritten,
        anomalies=msg.anomalies,
        completed=msg.completed,
    )


def close_result_from_pb(msg: pb.CloseWriterResponse) -> CloseResult:
    return CloseResult(
        counts=counts_from_pb(msg.counts),
        incomplete_sources=tuple(msg.incomplete_sources),
        incomplete_count=msg.incomplete_count,
    )


def writer_status_from_pb(msg: pb.WriterStatus) -> WriterStatus:
    return WriterStatus(
        writer_id=msg.writer_id,
        host=msg.host,
        pid=msg.pid,
        labels=dict(msg.labels),
        state=msg.state,
        pending_sources=msg.pending_sources,
        counts=counts_from_pb(msg.counts),
        opened_at=msg.opened_at,
        last_seen_at=msg.last_seen_at,
        closed_at=msg.closed_at,
    )


def checkpoint_from_pb(msg: pb.CheckpointStatus) -> CheckpointStatus:
    return CheckpointStatus(
        name=msg.name,
        completed_count=msg.completed_count,
        live_writers=msg.live_writers,
        pending_sources=msg.pending_sources,
        settling_sources=msg.settling_sources,
        anomalies=msg.anomalies,
        unreadable_files=msg.unreadable_files,
        created_at=msg.created_at,
        last_activity_at=msg.last_activity_at,
        writers=tuple(writer_status_from_pb(w) for w in msg.writers),
        fingerprint=dict(msg.fingerprint),
        owner=msg.owner,
        failed_sources=msg.failed_sources,
        max_attempts=msg.max_attempts,
        total=msg.total,
        # Only meaningful with a total (an older coordinator sends neither: proto3's 0 is no count).
        remaining=msg.remaining if msg.total > 0 else -1,
        claimed_sources=msg.claimed_sources,
    )


def replicas_from_pb(msg: pb.ListReplicasResponse) -> Replicas:
    return Replicas(
        replicas=tuple(
            Replica(
                r.name, r.grpc_address, r.http_address, r.owner, r.started_at, r.silent_s, tuple(r.shards)
            )
            for r in msg.replicas
        ),
        epoch=msg.epoch,
        answered_by=msg.answered_by,
    )


def event_data(text: str) -> dict[str, Any]:
    """Decode an event's ``data_json``; what is not a JSON object is kept rather than lost."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"value": value}


def event_from_pb(msg: pb.Event) -> Event:
    return Event(
        id=msg.id,
        checkpoint=msg.checkpoint,
        kind=msg.kind,
        message=msg.message,
        at=msg.at,
        writer_id=msg.writer_id,
        data=event_data(msg.data_json),
        severity=Severity.from_wire(msg.severity),
    )


def event_page_from_pb(msg: pb.ListEventsResponse) -> EventPage:
    # The wire says 0 for "no further page"; users get None, which cannot be mistaken for an id.
    return EventPage(
        events=tuple(event_from_pb(e) for e in msg.events), next_before_id=msg.next_before_id or None
    )


def progress_from_pb(msg: pb.GetProgressResponse) -> list[ProgressSample]:
    return [ProgressSample(at=p.at, completed_count=p.completed_count) for p in msg.samples]


def completed_page_from_pb(msg: pb.ListCompletedResponse) -> CompletedPage:
    return CompletedPage(source_ids=tuple(msg.source_ids), next_after=msg.next_after)


def import_result_from_pb(msg: pb.ImportCompletedResponse) -> ImportResult:
    return ImportResult(imported=msg.imported, completed_count=msg.completed_count)


def reset_result_from_pb(msg: pb.ResetCheckpointResponse) -> ResetResult:
    return ResetResult(moved_to=msg.moved_to, files_moved=msg.files_moved, writers_closed=msg.writers_closed)


def save_cursors_request(call: calls.SaveCursors) -> pb.SaveCursorsRequest:
    return pb.SaveCursorsRequest(
        handle=call.handle, cursors=[pb.Cursor(source_id=s, data=d) for s, d in call.cursors]
    )


def cursor_from_pb(msg: pb.GetCursorResponse) -> calls.SavedCursor | None:
    if not msg.found:
        return None
    return calls.SavedCursor(data=msg.data, saved_at=msg.saved_at, writer_id=msg.writer_id)


def failure_page_from_pb(msg: pb.ListFailuresResponse) -> FailurePage:
    return FailurePage(
        sources=tuple(
            SourceFailures(
                source_id=s.source_id,
                attempts=s.attempts,
                failed=s.failed,
                recent=tuple(FailedAttempt(a.reason, a.at, a.writer_id) for a in s.recent),
            )
            for s in msg.sources
        ),
        next_after=msg.next_after,
        max_attempts=msg.max_attempts,
    )


def list_failures_request(call: calls.ListFailures) -> pb.ListFailuresRequest:
    return pb.ListFailuresRequest(
        checkpoint=call.checkpoint,
        source_ids=list(call.source_ids),
        failed_only=call.failed_only,
        after=call.after,
        limit=call.limit,
    )


def watch_request(call: calls.WatchCheckpoint) -> pb.WatchCheckpointRequest:
    return pb.WatchCheckpointRequest(checkpoint=call.checkpoint, interval_ms=call.interval_ms)


# --------------------------------------------------------------------------- the table

ROUTES: dict[type[Call[Any]], Route[Any, Any, Any, Any]] = {}


def _add(
    call: type[C],
    rpc: Callable[[CoordinatorStub], grpc.UnaryUnaryMultiCallable[Req, Reply]],
    request: Callable[[C], Req],
    read: Callable[[Reply], T],
) -> None:
    # Typed per entry: mypy checks each builder against its call and each reader against its reply.
    ROUTES[call] = Route(rpc, request, read)


_add(
    calls.OpenWriter,
    lambda stub: stub.OpenWriter,
    lambda c: open_writer_request(c.spec),
    opened_from_pb,
)
_add(
    calls.KeepAlive,
    lambda stub: stub.KeepAlive,
    lambda c: pb.KeepAliveRequest(handle=c.handle),
    lambda r: r.lease_ttl_s,
)
_add(
    calls.ApplyDeltas,
    lambda stub: stub.ApplyDeltas,
    apply_deltas_request,
    lambda r: calls.BatchAnswer(counts_from_pb(r.counts), r.settled, r.refused),
)
_add(
    calls.AreCompleted,
    lambda stub: stub.AreCompleted,
    lambda c: pb.AreCompletedRequest(checkpoint=c.checkpoint, source_ids=list(c.source_ids)),
    lambda r: list(r.completed),
)
_add(
    calls.Flush,
    lambda stub: stub.Flush,
    lambda c: pb.FlushRequest(handle=c.handle),
    lambda r: r.completed,
)
_add(
    calls.CloseWriter,
    lambda stub: stub.CloseWriter,
    lambda c: pb.CloseWriterRequest(handle=c.handle),
    close_result_from_pb,
)
_add(
    calls.GetCheckpoint,
    lambda stub: stub.GetCheckpoint,
    lambda c: pb.GetCheckpointRequest(name=c.name),
    checkpoint_from_pb,
)
_add(
    calls.ListCheckpoints,
    lambda stub: stub.ListCheckpoints,
    lambda c: pb.ListCheckpointsRequest(after=c.after, limit=c.limit, without_writers=not c.writers),
    lambda r: CheckpointPage(tuple(checkpoint_from_pb(c) for c in r.checkpoints), r.next_after),
)
_add(
    calls.ListReplicas,
    lambda stub: stub.ListReplicas,
    lambda c: pb.ListReplicasRequest(),
    replicas_from_pb,
)
_add(
    calls.ListWriters,
    lambda stub: stub.ListWriters,
    lambda c: pb.ListWritersRequest(
        checkpoint=c.checkpoint, include_closed=c.include_closed, limit=c.limit, after=c.after
    ),
    lambda r: WriterPage(tuple(writer_status_from_pb(w) for w in r.writers), r.next_after),
)
_add(
    calls.ListEvents,
    lambda stub: stub.ListEvents,
    lambda c: pb.ListEventsRequest(checkpoint=c.checkpoint, limit=c.limit, before_id=c.before_id or 0),
    event_page_from_pb,
)
_add(
    calls.GetProgress,
    lambda stub: stub.GetProgress,
    lambda c: pb.GetProgressRequest(checkpoint=c.checkpoint, since=c.since or 0.0),
    progress_from_pb,
)
_add(
    calls.ListCompleted,
    lambda stub: stub.ListCompleted,
    lambda c: pb.ListCompletedRequest(checkpoint=c.checkpoint, after=c.after, limit=c.limit),
    completed_page_from_pb,
)
_add(
    calls.ImportCompleted,
    lambda stub: stub.ImportCompleted,
    lambda c: pb.ImportCompletedRequest(
        checkpoint=c.checkpoint, source_ids=list(c.source_ids), import_id=c.import_id
    ),
    import_result_from_pb,
)
_add(
    calls.ResetCheckpoint,
    lambda stub: stub.ResetCheckpoint,
    lambda c: pb.ResetCheckpointRequest(name=c.name, force=c.force),
    reset_result_from_pb,
)
_add(
    calls.SaveCursors,
    lambda stub: stub.SaveCursors,
    save_cursors_request,
    lambda r: calls.CursorsSaved(saved=r.saved, completed=r.completed),
)
_add(
    calls.GetCursor,
    lambda stub: stub.GetCursor,
    lambda c: pb.GetCursorRequest(checkpoint=c.checkpoint, source_id=c.source_id),
    cursor_from_pb,
)
_add(
    calls.ReportFailure,
    lambda stub: stub.ReportFailure,
    lambda c: pb.ReportFailureRequest(
        handle=c.handle, source_id=c.source_id, reason=c.reason, attempt_id=c.attempt_id
    ),
    lambda r: FailureReport(attempts=r.attempts, failed=r.failed, max_attempts=r.max_attempts),
)
_add(
    calls.Acquire,
    lambda stub: stub.Acquire,
    lambda c: pb.AcquireRequest(handle=c.handle, source_ids=list(c.source_ids)),
    lambda r: [Claim(c.source_id, c.state, c.token, c.holder, c.until) for c in r.claims],
)
_add(
    calls.TokenIsCurrent,
    lambda stub: stub.TokenIsCurrent,
    lambda c: pb.TokenIsCurrentRequest(checkpoint=c.checkpoint, source_id=c.source_id, token=c.token),
    lambda r: bool(r.current),
)
_add(
    calls.ListFailures,
    lambda stub: stub.ListFailures,
    list_failures_request,
    failure_page_from_pb,
)
_add(
    calls.RetryFailed,
    lambda stub: stub.RetryFailed,
    lambda c: pb.RetryFailedRequest(checkpoint=c.checkpoint, source_ids=list(c.source_ids)),
    lambda r: r.cleared,
)
_add(
    calls.SetFailureBudget,
    lambda stub: stub.SetFailureBudget,
    lambda c: pb.SetFailureBudgetRequest(checkpoint=c.checkpoint, max_attempts=c.max_attempts),
    lambda r: calls.FailureBudget(max_attempts=r.max_attempts, failed_sources=r.failed_sources),
)
_add(
    calls.DeclareSources,
    lambda stub: stub.DeclareSources,
    lambda c: pb.DeclareSourcesRequest(checkpoint=c.checkpoint, source_ids=list(c.source_ids), count=c.count),
    lambda r: calls.Declared(total=r.total, remaining=r.remaining),
)
_add(
    calls.ListRemaining,
    lambda stub: stub.ListRemaining,
    lambda c: pb.ListRemainingRequest(checkpoint=c.checkpoint, after=c.after, limit=c.limit),
    lambda r: CompletedPage(source_ids=tuple(r.source_ids), next_after=r.next_after),
)
