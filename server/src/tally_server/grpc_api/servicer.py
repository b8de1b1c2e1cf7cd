"""tally.v1.Coordinator: each method translates one request and calls one service method."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server import auth
from tally_server.domain import validation
from tally_server.domain.ledger import ApplyCounts
from tally_server.service import CheckpointView, CoordinatorService, WriterView

Context = Any  # grpc.aio.ServicerContext; untyped in grpc-stubs
T = TypeVar("T")

# Requests with more items than this are unpacked and validated in a worker thread: 100k deltas take
# a few hundred milliseconds, which every other call (heartbeats too) would wait for on the loop.
OFF_LOOP_ITEMS = 2048


async def _unpack(items: Sequence[Any], unpack: Callable[[], T]) -> T:
    if len(items) > OFF_LOOP_ITEMS:
        return await asyncio.to_thread(unpack)
    return unpack()


def _counts(c: ApplyCounts) -> pb.ApplyCounts:
    return pb.ApplyCounts(
        applied=c.applied,
        skipped=c.skipped,
        rewritten=c.rewritten,
        anomalies=c.anomalies,
        completed=c.completed,
    )


_ON_MISMATCH = {
    pb.ON_MISMATCH_REFUSE: "refuse",
    pb.ON_MISMATCH_RESET: "reset",
    pb.ON_MISMATCH_IGNORE: "ignore",
}


def writer_status(w: WriterView) -> pb.WriterStatus:
    return pb.WriterStatus(
        writer_id=w.writer_id,
        host=w.host,
        pid=w.pid,
        labels=w.labels,
        state=w.state,
        pending_sources=w.pending_sources,
        counts=_counts(w.counts),
        opened_at=w.opened_at,
        last_seen_at=w.last_seen_at,
        closed_at=w.closed_at,
    )


def checkpoint_status(v: CheckpointView) -> pb.CheckpointStatus:
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
    )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, service: CoordinatorService) -> None:
        self._service = service

    def _source_ids(self, ids: Sequence[str]) -> validation.CheckedIds:
        return validation.source_ids(ids, self._service.limits)  # counts them before reading any

    async def OpenWriter(self, request: pb.OpenWriterRequest, context: Context) -> pb.OpenWriterResponse:
        validation.pid(request.pid)
        opened = await self._service.open_writer(
            request.checkpoint,
            writer_id=request.writer_id,
            fingerprint=dict(request.fingerprint),
            labels=dict(request.labels),
            host=request.host,
            pid=request.pid,
            on_mismatch=_ON_MISMATCH.get(request.on_mismatch, "invalid"),
            allow_reset=auth.current().may_reset(request.checkpoint),
        )
        return pb.OpenWriterResponse(
            handle=opened.handle,
            writer_id=opened.writer_id,
            lease_ttl_s=opened.lease_ttl_s,
            completed_count=opened.completed_count,
            settle_ms=opened.settle_ms,
        )

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Context) -> pb.KeepAliveResponse:
        return pb.KeepAliveResponse(lease_ttl_s=await self._service.keep_alive(request.handle))

    async def ApplyDeltas(self, request: pb.ApplyDeltasRequest, context: Context) -> pb.ApplyDeltasResponse:
        limits = self._service.limits
        if len(request.deltas) > limits.max_deltas_per_call:  # before a tuple is built for any of them
            raise validation.too_many_deltas(limits, len(request.deltas))
        batch = await _unpack(
            request.deltas,
            lambda: validation.deltas([(d.task_id, d.source_id, d.delta) for d in request.deltas], limits),
        )
        counts = await self._service.apply_deltas(request.handle, batch)
        return pb.ApplyDeltasResponse(counts=_counts(counts))

    async def AreCompleted(
        self, request: pb.AreCompletedRequest, context: Context
    ) -> pb.AreCompletedResponse:
        ids = await _unpack(request.source_ids, lambda: self._source_ids(request.source_ids))
        done = await self._service.are_completed(request.checkpoint, ids)
        return pb.AreCompletedResponse(completed=done)

    async def Flush(self, request: pb.FlushRequest, context: Context) -> pb.FlushResponse:
        return pb.FlushResponse(completed=await self._service.flush(request.handle))

    async def CloseWriter(self, request: pb.CloseWriterRequest, context: Context) -> pb.CloseWriterResponse:
        closed = await self._service.close_writer(request.handle)
        return pb.CloseWriterResponse(
            counts=_counts(closed.counts),
            incomplete_sources=closed.incomplete_sources,
            incomplete_count=closed.incomplete_count,
        )

    async def GetCheckpoint(self, request: pb.GetCheckpointRequest, context: Context) -> pb.CheckpointStatus:
        return checkpoint_status(await self._service.get_checkpoint(request.name))

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Context
    ) -> pb.ListCheckpointsResponse:
        # A scoped token sees only the checkpoints it may read.
        views = [v for v in await self._service.list_checkpoints() if auth.current().may_read(v.name)]
        return pb.ListCheckpointsResponse(checkpoints=[checkpoint_status(v) for v in views])

    async def ListWriters(self, request: pb.ListWritersRequest, context: Context) -> pb.ListWritersResponse:
        writers = await self._service.list_writers(
            request.checkpoint, include_closed=request.include_closed, limit=request.limit or 100
        )
        return pb.ListWritersResponse(writers=[writer_status(w) for w in writers])

    async def ListEvents(self, request: pb.ListEventsRequest, context: Context) -> pb.ListEventsResponse:
        validation.before_id(request.before_id)
        page = await self._service.list_events(
            request.checkpoint, limit=request.limit or 50, before_id=request.before_id
        )
        events = [
            pb.Event(
                id=e.id,
                checkpoint=e.checkpoint,
                kind=e.kind,
                message=e.message,
                at=e.at,
                writer_id=e.writer_id,
                data_json=json.dumps(e.data, default=str),
            )
            for e in page.events
        ]
        return pb.ListEventsResponse(events=events, next_before_id=page.next_before_id)

    async def GetProgress(self, request: pb.GetProgressRequest, context: Context) -> pb.GetProgressResponse:
        samples = await self._service.progress(request.checkpoint, since=request.since)
        return pb.GetProgressResponse(
            samples=[pb.ProgressSample(at=x.at, completed_count=x.completed_count) for x in samples]
        )

    async def WatchCheckpoint(
        self, request: pb.WatchCheckpointRequest, context: Context
    ) -> AsyncIterator[pb.CheckpointStatus]:
        async for view in self._service.watch(
            request.checkpoint, interval_s=(request.interval_ms or 1000) / 1000
        ):
            yield checkpoint_status(view)

    async def ListCompleted(
        self, request: pb.ListCompletedRequest, context: Context
    ) -> pb.ListCompletedResponse:
        page = await self._service.list_completed(
            request.checkpoint, after=request.after, limit=request.limit or 10_000
        )
        return pb.ListCompletedResponse(source_ids=page.source_ids, next_after=page.next_after)

    async def ImportCompleted(
        self, request: pb.ImportCompletedRequest, context: Context
    ) -> pb.ImportCompletedResponse:
        ids = await _unpack(request.source_ids, lambda: self._source_ids(request.source_ids))
        result = await self._service.import_completed(request.checkpoint, ids, import_id=request.import_id)
        return pb.ImportCompletedResponse(imported=result.imported, completed_count=result.completed_count)

    async def ResetCheckpoint(
        self, request: pb.ResetCheckpointRequest, context: Context
    ) -> pb.ResetCheckpointResponse:
        result = await self._service.reset_checkpoint(request.name, force=request.force)
        return pb.ResetCheckpointResponse(
            moved_to=result.moved_to, files_moved=result.files_moved, writers_closed=result.writers_closed
        )
