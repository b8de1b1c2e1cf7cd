"""``/v1/writers``: open a writer, then renew its lease, apply deltas, flush and close it by handle."""

# No "from __future__ import annotations": the Annotated dependencies name the local guard, which
# FastAPI could not resolve from a string.
import base64
import binascii
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from tally_server.auth import Principal
from tally_server.errors import InvalidArgument
from tally_server.http_api import bodies
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import ClosedWriter, CoordinatorService, OpenedWriter

TAGS: list[str | Enum] = ["writers"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the writer routes (open, keepalive, deltas, flush, close) to ``app``."""
    limits = service.limits

    @app.post(
        "/v1/writers",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=OpenedWriter,
        openapi_extra=bodies.request_body(s.OpenWriterBody),
    )
    async def open_writer(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("OpenWriter", checkpoint_in_body=True))],
    ) -> OpenedWriter:
        """Register a writer of a checkpoint (refuses a writer_id that is live)."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.OpenWriterBody, raw))
        caller.require("OpenWriter", body.checkpoint)
        return await service.open_writer(
            body.checkpoint,
            writer_id=body.writer_id,
            fingerprint=body.fingerprint,
            labels=body.labels,
            host=body.host,
            pid=body.pid,
            on_mismatch=body.on_mismatch,
            session_token=body.session_token,
            allow_reset=caller.may_reset(body.checkpoint),
        )

    @app.post(
        "/v1/writers/{handle}/keepalive",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.KeepAliveReply,
        dependencies=[Depends(guard.requires("KeepAlive"))],
    )
    async def keep_alive(handle: s.HandleParam) -> r.KeepAliveReply:
        """Renew the writer's lease; 404 means its pending state is gone."""
        return r.KeepAliveReply(lease_ttl_s=await service.keep_alive(handle))

    @app.post(
        "/v1/writers/{handle}/deltas",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.ApplyDeltasReply,
        dependencies=[Depends(guard.requires("ApplyDeltas"))],
        openapi_extra=bodies.request_body(s.ApplyDeltasBody),
    )
    async def apply_deltas(handle: s.HandleParam, request: Request) -> r.ApplyDeltasReply:
        """Apply (task_id, source_id, delta) in order under the counting rules."""
        batch, head = await bodies.parse(request, lambda raw: bodies.deltas(raw, limits))
        applied = await service.apply_deltas(handle, batch, head.batch_seq, ordered=head.ordered)
        return r.ApplyDeltasReply(counts=applied.counts, settled=applied.settled, refused=applied.refused)

    @app.post(
        "/v1/writers/{handle}/flush",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.FlushReply,
        dependencies=[Depends(guard.requires("Flush"))],
    )
    async def flush(handle: s.HandleParam) -> r.FlushReply:
        """Barrier: returns when every completion from deltas applied so far is durable."""
        return r.FlushReply(completed=await service.flush(handle))

    @app.post(
        "/v1/writers/{handle}/cursors",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.SaveCursorsReply,
        dependencies=[Depends(guard.requires("SaveCursors"))],
        openapi_extra=bodies.request_body(s.SaveCursorsBody),
    )
    async def save_cursors(handle: s.HandleParam, request: Request) -> r.SaveCursorsReply:
        """Save where the writer got to inside sources (each at most 4 KiB): durable on return."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.SaveCursorsBody, raw))
        items = [(c.source_id, _base64(i, c.data)) for i, c in enumerate(body.cursors)]
        saved = await service.save_cursors(handle, items)
        return r.SaveCursorsReply(saved=saved.saved, completed=saved.completed)

    @app.post(
        "/v1/writers/{handle}/close",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=ClosedWriter,
        dependencies=[Depends(guard.requires("CloseWriter"))],
    )
    async def close_writer(handle: s.HandleParam) -> ClosedWriter:
        """Flush, complete settling sources, drop pending state; lists what was left incomplete.

        A close sent again (its answer was lost) gets the same answer, also after a coordinator
        restart (then without the list: `incomplete_count` says how many).
        """
        return await service.close_writer(handle)


def _base64(index: int, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(
            f"cursors[{index}].data is not base64; send the cursor's bytes base64-encoded (RFC 4648)",
            field=f"cursors[{index}].data",
        ) from None
