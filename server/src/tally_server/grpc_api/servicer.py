"""tally.v1.Coordinator: each method translates one request and calls one service method."""

from __future__ import annotations

from typing import Any

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.domain.ledger import ApplyCounts
from tally_server.service import CheckpointView, CoordinatorService

Context = Any  # grpc.aio.ServicerContext; untyped in grpc-stubs


def _counts(c: ApplyCounts) -> pb.ApplyCounts:
    return pb.ApplyCounts(
        applied=c.applied,
        skipped=c.skipped,
        rewritten=c.rewritten,
        anomalies=c.anomalies,
        completed=c.completed,
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
        writers=[
            pb.WriterStatus(
                writer_id=w.writer_id,
                host=w.host,
                pid=w.pid,
                labels=w.labels,
                state=w.state,
                pending_sources=w.pending_sources,
                counts=_counts(w.counts),
                opened_at=w.opened_at,
                last_seen_at=w.last_seen_at,
            )
            for w in v.writers
        ],
    )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):  # type: ignore[misc]
    def __init__(self, service: CoordinatorService) -> None:
        self._service = service

    async def OpenWriter(self, request: pb.OpenWriterRequest, context: Context) -> pb.OpenWriterResponse:
        opened = await self._service.open_writer(
            request.checkpoint,
            writer_id=request.writer_id,
            fingerprint=dict(request.fingerprint),
            labels=dict(request.labels),
            host=request.host,
            pid=request.pid,
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
        batch = [(d.task_id, d.source_id, d.delta) for d in request.deltas]
        counts = await self._service.apply_deltas(request.handle, batch)
        return pb.ApplyDeltasResponse(counts=_counts(counts))

    async def AreCompleted(
        self, request: pb.AreCompletedRequest, context: Context
    ) -> pb.AreCompletedResponse:
        done = await self._service.are_completed(request.checkpoint, list(request.source_ids))
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
        views = await self._service.list_checkpoints()
        return pb.ListCheckpointsResponse(checkpoints=[checkpoint_status(v) for v in views])
