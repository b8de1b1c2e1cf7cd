"""tally.v1 messages from the service's views (service/views.py), and request enums to their values.

The one place that knows both shapes: the servicer translates requests and calls the service,
these build the replies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tally.v1 import coordinator_pb2 as pb
from tally_server.domain.ledger import ApplyCounts
from tally_server.service import (
    CheckpointView,
    ClosedWriter,
    CompletedPage,
    EventPage,
    EventView,
    FailurePage,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ReplicasView,
    ResetResult,
    WriterView,
)

_ON_MISMATCH = {
    pb.ON_MISMATCH_REFUSE: "refuse",
    pb.ON_MISMATCH_RESET: "reset",
    pb.ON_MISMATCH_IGNORE: "ignore",
}


def on_mismatch(value: pb.OnMismatch) -> str:
    """The service's name for a request's ``on_mismatch`` ("invalid" for a number it does not know)."""
    return _ON_MISMATCH.get(value, "invalid")


def counts(c: ApplyCounts) -> pb.ApplyCounts:
    """Counters as their message."""
    return pb.ApplyCounts(
        applied=c.applied,
        skipped=c.skipped,
        rewritten=c.rewritten,
        anomalies=c.anomalies,
        completed=c.completed,
    )


def opened_writer(o: OpenedWriter) -> pb.OpenWriterResponse:
    """An open writer's answer as its message."""
    return pb.OpenWriterResponse(
        handle=o.handle,
        writer_id=o.writer_id,
        lease_ttl_s=o.lease_ttl_s,
        completed_count=o.completed_count,
        settle_ms=o.settle_ms,
        accepts_delta_columns=o.accepts_delta_columns,
        max_batches_in_flight=o.max_batches_in_flight,
    )


def closed_writer(c: ClosedWriter) -> pb.CloseWriterResponse:
    """A close's outcome as its message."""
    return pb.CloseWriterResponse(
        counts=counts(c.counts),
        incomplete_sources=c.incomplete_sources,
        incomplete_count=c.incomplete_count,
    )


def writer_status(w: WriterView) -> pb.WriterStatus:
    """A writer's view as its message."""
    return pb.WriterStatus(
        writer_id=w.writer_id,
        host=w.host,
        pid=w.pid,
        labels=w.labels,
        state=w.state,
        pending_sources=w.pending_sources,
        counts=counts(w.counts),
        opened_at=w.opened_at,
        last_seen_at=w.last_seen_at,
        closed_at=w.closed_at,
    )


def checkpoint_status(v: CheckpointView) -> pb.CheckpointStatus:
    """A checkpoint's status as its message."""
    return pb.CheckpointStatus(
        name=v.name,
        completed_count=v.completed_count,
        live_writers=v.live_writers,
        pending_sources=v.pending_sources,
        settling_sources=v.settling_sources,
        anomalies=v.anomalies,
        unreadable_files=v.unreadable_files,
        created_at=v.created_at,
        last_activity_at=v.last_activity_at,
        fingerprint=v.fingerprint,
        writers=[writer_status(w) for w in v.writers],
        owner=v.owner,
        failed_sources=v.failed_sources,
        max_attempts=v.max_attempts,
        total=v.total,
        remaining=v.remaining,
        claimed_sources=v.claimed_sources,
    )


def failure_page(page: FailurePage) -> pb.ListFailuresResponse:
    """A page of sources with failed attempts as its message."""
    return pb.ListFailuresResponse(
        sources=[
            pb.SourceFailures(
                source_id=s.source_id,
                attempts=s.attempts,
                failed=s.failed,
                recent=[pb.FailedAttempt(reason=a.reason, at=a.at, writer_id=a.writer_id) for a in s.recent],
            )
            for s in page.sources
        ],
        next_after=page.next_after,
        max_attempts=page.max_attempts,
    )


def replicas(v: ReplicasView) -> pb.ListReplicasResponse:
    """The store's replicas as their message."""
    return pb.ListReplicasResponse(
        replicas=[
            pb.Replica(
                name=r.name,
                grpc_address=r.grpc_address,
                http_address=r.http_address,
                owner=r.owner,
                started_at=r.started_at,
                silent_s=r.silent_s,
                shards=r.shards,
            )
            for r in v.replicas
        ],
        epoch=v.epoch,
        answered_by=v.answered_by,
    )


def event(e: EventView) -> pb.Event:
    """An event as its message."""
    return pb.Event(
        id=e.id,
        checkpoint=e.checkpoint,
        kind=e.kind,
        message=e.message,
        at=e.at,
        writer_id=e.writer_id,
        data_json=json.dumps(e.data, default=str),  # free-form per kind: JSON in a string field
        severity=e.severity,
    )


def event_page(page: EventPage) -> pb.ListEventsResponse:
    """A page of events as its message."""
    return pb.ListEventsResponse(events=[event(e) for e in page.events], next_before_id=page.next_before_id)


def progress(samples: Sequence[ProgressSample]) -> pb.GetProgressResponse:
    """Progress samples as their message."""
    return pb.GetProgressResponse(
        samples=[pb.ProgressSample(at=x.at, completed_count=x.completed_count) for x in samples]
    )


def completed_page(page: CompletedPage) -> pb.ListCompletedResponse:
    """A page of completed ids as its message."""
    return pb.ListCompletedResponse(source_ids=page.source_ids, next_after=page.next_after)


def import_result(result: ImportResult) -> pb.ImportCompletedResponse:
    """An import's outcome as its message."""
    return pb.ImportCompletedResponse(imported=result.imported, completed_count=result.completed_count)


def reset_result(result: ResetResult) -> pb.ResetCheckpointResponse:
    """A reset's outcome as its message."""
    return pb.ResetCheckpointResponse(
        moved_to=result.moved_to, files_moved=result.files_moved, writers_closed=result.writers_closed
    )
