"""tally.v1.Coordinator: each method translates one request and calls one service method."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server import auth
from tally_server.domain import validation
from tally_server.domain.words import count
from tally_server.errors import InvalidArgument
from tally_server.grpc_api import convert
from tally_server.grpc_api.columns import ColumnsRequest
from tally_server.service import CoordinatorService

Context = Any  # grpc.aio.ServicerContext; untyped in grpc-stubs
T = TypeVar("T")

# Requests with more items than this are unpacked and validated in a worker thread: 100k deltas take
# a few hundred milliseconds, which every other call (heartbeats too) would wait for on the loop.
OFF_LOOP_ITEMS = 2048


async def _unpack(items: Sequence[Any], unpack: Callable[[], T]) -> T:
    if len(items) > OFF_LOOP_ITEMS:
        return await asyncio.to_thread(unpack)
    return unpack()


@contextmanager
def _checkpoint_field(field: str) -> Iterator[None]:
    """Name the checkpoint ``field`` in a refusal of it (GetCheckpoint and ResetCheckpoint say ``name``)."""
    try:
        yield
    except InvalidArgument as exc:
        if exc.details.get("field") == "checkpoint":
            exc.details["field"] = field
        raise


def _rows(deltas: Sequence[pb.Delta]) -> list[tuple[str, str, int]]:
    return [(d.task_id, d.source_id, d.delta) for d in deltas]


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """The ``tally.v1.Coordinator`` gRPC service.

    Each RPC converts its request, calls the coordinator service and converts the answer.
    """

    def __init__(self, service: CoordinatorService) -> None:
        self._service = service

    def _source_ids(self, ids: Sequence[str]) -> validation.CheckedIds:
        return validation.source_ids(ids, self._service.limits)  # counts them before reading any

    async def OpenWriter(self, request: pb.OpenWriterRequest, context: Context) -> pb.OpenWriterResponse:
        """Register a writer of a checkpoint."""
        validation.pid(request.pid)
        opened = await self._service.open_writer(
            request.checkpoint,
            writer_id=request.writer_id,
            fingerprint=dict(request.fingerprint),
            labels=dict(request.labels),
            host=request.host,
            pid=request.pid,
            on_mismatch=convert.on_mismatch(request.on_mismatch),
            allow_reset=auth.current().may_reset(request.checkpoint),
            session_token=request.session_token,
        )
        return convert.opened_writer(opened)

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Context) -> pb.KeepAliveResponse:
        """Renew a writer's lease."""
        return pb.KeepAliveResponse(lease_ttl_s=await self._service.keep_alive(request.handle))

    async def ApplyDeltas(
        self, request: pb.ApplyDeltasRequest | ColumnsRequest, context: Context
    ) -> pb.ApplyDeltasResponse:
        """Apply a batch of deltas in order under the counting rules."""
        limits = self._service.limits
        batch: validation.CheckedDeltas
        if isinstance(request, ColumnsRequest):  # plain columns, read and checked from the bytes
            batch = request.batch
        elif request.HasField("columns"):
            if request.deltas:
                raise InvalidArgument(
                    f"the batch came both as {count(len(request.deltas), 'delta')} and as columns; "
                    "send one of the two",
                    field="columns",
                )
            cols = request.columns
            if len(cols.task_ids) > limits.max_deltas_per_call:  # before a tuple is built for any
                raise validation.too_many_deltas(limits, len(cols.task_ids))
            batch = await _unpack(
                cols.task_ids,
                lambda: validation.delta_columns(
                    cols.task_ids, cols.source_ids, cols.deltas, limits, int64=True
                ),
            )
        else:
            if len(request.deltas) > limits.max_deltas_per_call:  # before a tuple is built for any
                raise validation.too_many_deltas(limits, len(request.deltas))
            batch = await _unpack(
                request.deltas,
                lambda: validation.deltas(
                    [(d.task_id, d.source_id, d.delta) for d in request.deltas], limits
                ),
            )
        applied = await self._service.apply_deltas(
            request.handle, batch, request.batch_seq, ordered=request.ordered
        )
        return pb.ApplyDeltasResponse(
            counts=convert.counts(applied.counts), settled=applied.settled, refused=applied.refused
        )

    async def AreCompleted(
        self, request: pb.AreCompletedRequest, context: Context
    ) -> pb.AreCompletedResponse:
        """Parallel booleans from the checkpoint's live completed set."""
        # Plain ids are checked at C speed on the loop (a thread hop would cost more than the check).
        ids = validation.plain_source_ids(request.source_ids, self._service.limits)
        if ids is None:
            ids = await _unpack(request.source_ids, lambda: self._source_ids(request.source_ids))
        done = await self._service.are_completed(request.checkpoint, ids)
        return pb.AreCompletedResponse(completed=done)

    async def Flush(self, request: pb.FlushRequest, context: Context) -> pb.FlushResponse:
        """Return once every completion from deltas applied so far is durable."""
        return pb.FlushResponse(completed=await self._service.flush(request.handle))

    async def CloseWriter(self, request: pb.CloseWriterRequest, context: Context) -> pb.CloseWriterResponse:
        """Close a writer: complete its settling sources, report what was left incomplete."""
        return convert.closed_writer(await self._service.close_writer(request.handle))

    async def GetCheckpoint(self, request: pb.GetCheckpointRequest, context: Context) -> pb.CheckpointStatus:
        """One checkpoint's status."""
        with _checkpoint_field("name"):
            return convert.checkpoint_status(await self._service.get_checkpoint(request.name))

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Context
    ) -> pb.ListCheckpointsResponse:
        """A page of checkpoints' statuses, by name."""
        # A scoped token sees only the checkpoints it may read (pages are made of those).
        page = await self._service.list_checkpoints(
            after=request.after,
            limit=request.limit,
            visible=auth.current().may_read,
            writers=not request.without_writers,
        )
        return pb.ListCheckpointsResponse(
            checkpoints=[convert.checkpoint_status(v) for v in page.checkpoints], next_after=page.next_after
        )

    async def ListWriters(self, request: pb.ListWritersRequest, context: Context) -> pb.ListWritersResponse:
        """A page of a checkpoint's writers: live ones first, then past ones if asked."""
        page = await self._service.list_writers(
            request.checkpoint,
            include_closed=request.include_closed,
            after=request.after,
            limit=request.limit,
        )
        return pb.ListWritersResponse(
            writers=[convert.writer_status(w) for w in page.writers], next_after=page.next_after
        )

    async def ListEvents(self, request: pb.ListEventsRequest, context: Context) -> pb.ListEventsResponse:
        """A checkpoint's events, newest first, paged."""
        validation.before_id(request.before_id)
        page = await self._service.list_events(
            request.checkpoint, limit=request.limit or 50, before_id=request.before_id
        )
        return convert.event_page(page)

    async def GetProgress(self, request: pb.GetProgressRequest, context: Context) -> pb.GetProgressResponse:
        """A checkpoint's completed count over time."""
        return convert.progress(await self._service.progress(request.checkpoint, since=request.since))

    async def WatchCheckpoint(
        self, request: pb.WatchCheckpointRequest, context: Context
    ) -> AsyncIterator[pb.CheckpointStatus]:
        """Stream the checkpoint's status whenever it changes."""
        async for view in self._service.watch(
            request.checkpoint, interval_s=(request.interval_ms or 1000) / 1000
        ):
            yield convert.checkpoint_status(view)

    async def ListCompleted(
        self, request: pb.ListCompletedRequest, context: Context
    ) -> pb.ListCompletedResponse:
        """A page of completed ids in byte order."""
        page = await self._service.list_completed(
            request.checkpoint, after=request.after, limit=request.limit or 10_000
        )
        return convert.completed_page(page)

    async def SaveCursors(self, request: pb.SaveCursorsRequest, context: Context) -> pb.SaveCursorsResponse:
        """Save where a writer got to inside sources: durable on return."""
        saved = await self._service.save_cursors(
            request.handle, [(c.source_id, c.data) for c in request.cursors]
        )
        return pb.SaveCursorsResponse(saved=saved.saved, completed=saved.completed)

    async def GetCursor(self, request: pb.GetCursorRequest, context: Context) -> pb.GetCursorResponse:
        """The cursor last saved for a source; none once it is completed."""
        found = await self._service.get_cursor(request.checkpoint, request.source_id)
        return pb.GetCursorResponse(
            found=found.found, data=found.data, saved_at=found.saved_at, writer_id=found.writer_id
        )

    async def ReportFailure(
        self, request: pb.ReportFailureRequest, context: Context
    ) -> pb.ReportFailureResponse:
        """Count a failed attempt at a source (durable on return)."""
        done = await self._service.report_failure(
            request.handle, request.source_id, request.reason, request.attempt_id
        )
        return pb.ReportFailureResponse(
            attempts=done.attempts, failed=done.failed, max_attempts=done.max_attempts
        )

    async def ListFailures(
        self, request: pb.ListFailuresRequest, context: Context
    ) -> pb.ListFailuresResponse:
        """Sources with failed attempts: those asked about, or a page of all."""
        page = await self._service.list_failures(
            request.checkpoint,
            source_ids=list(request.source_ids),
            failed_only=request.failed_only,
            after=request.after,
            limit=request.limit,
        )
        return convert.failure_page(page)

    async def RetryFailed(self, request: pb.RetryFailedRequest, context: Context) -> pb.RetryFailedResponse:
        """Clear sources' failed attempts: they run again."""
        return pb.RetryFailedResponse(
            cleared=await self._service.retry_failed(request.checkpoint, list(request.source_ids))
        )

    async def SetFailureBudget(
        self, request: pb.SetFailureBudgetRequest, context: Context
    ) -> pb.SetFailureBudgetResponse:
        """Set a checkpoint's failure budget (0: unlimited)."""
        budget, failed = await self._service.set_failure_budget(request.checkpoint, request.max_attempts)
        return pb.SetFailureBudgetResponse(max_attempts=budget, failed_sources=failed)

    async def Acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        """Claim sources for a writer: acquired (with a fencing token), held, completed or failed."""
        claims = await self._service.acquire(request.handle, list(request.source_ids))
        return pb.AcquireResponse(
            claims=[
                pb.Claim(source_id=c.source_id, state=c.state, token=c.token, holder=c.holder, until=c.until)
                for c in claims
            ]
        )

    async def TokenIsCurrent(
        self, request: pb.TokenIsCurrentRequest, context: Context
    ) -> pb.TokenIsCurrentResponse:
        """Whether a fencing token is the live claim on a source."""
        check = await self._service.token_is_current(request.checkpoint, request.source_id, request.token)
        return pb.TokenIsCurrentResponse(current=check.current, live_token=check.live_token)

    async def DeclareSources(
        self, request: pb.DeclareSourcesRequest, context: Context
    ) -> pb.DeclareSourcesResponse:
        """Declare a checkpoint's sources (idempotent, additive), or only how many there are."""
        ids = await _unpack(request.source_ids, lambda: self._source_ids(request.source_ids))
        total, remaining = await self._service.declare_sources(request.checkpoint, ids, request.count)
        return pb.DeclareSourcesResponse(total=total, remaining=remaining)

    async def ListRemaining(
        self, request: pb.ListRemainingRequest, context: Context
    ) -> pb.ListRemainingResponse:
        """Declared sources not completed yet, in byte order, paged."""
        page = await self._service.list_remaining(
            request.checkpoint, after=request.after, limit=request.limit
        )
        return pb.ListRemainingResponse(source_ids=page.source_ids, next_after=page.next_after)

    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: Context
    ) -> pb.ListReplicasResponse:
        """The coordinators serving the store: which owns it, which are replicas."""
        return convert.replicas(await self._service.list_replicas())

    async def ImportCompleted(
        self, request: pb.ImportCompletedRequest, context: Context
    ) -> pb.ImportCompletedResponse:
        """Adopt completions made elsewhere into their own file."""
        ids = await _unpack(request.source_ids, lambda: self._source_ids(request.source_ids))
        result = await self._service.import_completed(request.checkpoint, ids, import_id=request.import_id)
        return convert.import_result(result)

    async def ResetCheckpoint(
        self, request: pb.ResetCheckpointRequest, context: Context
    ) -> pb.ResetCheckpointResponse:
        """Start a checkpoint over; its files go to the trash folder."""
        with _checkpoint_field("name"):
            return convert.reset_result(
                await self._service.reset_checkpoint(request.name, force=request.force)
            )
