"""gRPC transports (blocking and grpc.aio) over the generated ``tally.v1`` stub."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from tally import _convert as convert
from tally._config import read_pem
from tally._transport import TlsFiles
from tally._types import (
    ApplyCounts,
    CheckpointStatus,
    CloseResult,
    CompletedPage,
    Delta,
    EventPage,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ResetResult,
    WriterSpec,
    WriterStatus,
)
from tally.errors import StatusCode, TallyError, Unavailable, error_for_code
from tally.v1.coordinator_pb2_grpc import CoordinatorStub

# The one gRPC -> SDK status table.
_STATUS: dict[grpc.StatusCode, StatusCode] = {
    grpc.StatusCode.CANCELLED: StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN: StatusCode.UNKNOWN,
    grpc.StatusCode.INVALID_ARGUMENT: StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED: StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND: StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED: StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION: StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED: StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE: StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED: StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL: StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE: StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS: StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAUTHENTICATED: StatusCode.UNAUTHENTICATED,
}

#: Optional trailing-metadata entry in which a server may put JSON error details.
DETAILS_METADATA_KEY = "tally-error-details"

# Checkpoint listings can be large (one entry per writer); lift gRPC's 4 MB receive default.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


def error_from_rpc(
    code: grpc.StatusCode | None, message: str | None, metadata: Any, target: str, tls: bool | None = None
) -> TallyError:
    """Translate a failed RPC's status into the SDK's error type.

    ``tls`` (whether the channel uses TLS) adds a hint when the failure looks like a TLS mismatch.
    """
    status = _STATUS.get(code, StatusCode.UNKNOWN) if code is not None else StatusCode.UNKNOWN
    text = message or (code.name if code is not None else "RPC failed")
    if status in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED):
        # gRPC's own text ("failed to connect to all addresses ...") does not say where.
        text = f"Tally coordinator at {target} is unavailable ({status.value}): {text}"
        if tls is not None:
            text += _tls_hint(text, tls)
    return error_for_code(status, text, _details(metadata))


def _tls_hint(text: str, tls: bool) -> str:
    # gRPC reports a TLS mismatch only as a closed socket or a failed handshake; say what may cause it.
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            " (the coordinator's certificate is not signed by a CA this client trusts: pass ca_cert or set "
            "TALLY_CA_CERT)"
        )
    if "Socket closed" in text or "Connection reset" in text:
        if tls:
            return (
                " (if the coordinator requires client certificates, pass client_cert and client_key or set "
                "TALLY_CLIENT_CERT and TALLY_CLIENT_KEY)"
            )
        return " (if the coordinator serves TLS, use a grpcs:// address)"
    return ""


def _details(metadata: Any) -> dict[str, Any]:
    for key, value in _pairs(metadata):
        if key == DETAILS_METADATA_KEY:
            try:
                parsed = json.loads(value)
            except (TypeError, ValueError):
                return {}
            return parsed if isinstance(parsed, dict) else {}
    return {}


def _pairs(metadata: Any) -> Iterable[tuple[str, Any]]:
    if not metadata:
        return ()
    try:
        return [(str(k), v) for k, v in metadata]
    except (TypeError, ValueError):
        return ()


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """TLS credentials: trust ``ca_cert`` (else the system's roots); present the client pair if set."""

    def read(what: str, path: str | None) -> bytes | None:
        return read_pem(what, path) if path is not None else None

    return grpc.ssl_channel_credentials(
        root_certificates=read("ca_cert", tls.ca_cert),
        private_key=read("client_key", tls.client_key),
        certificate_chain=read("client_cert", tls.client_cert),
    )


class GrpcTransport:
    """Blocking transport over a ``grpc.Channel``."""

    def __init__(self, target: str, *, token: str | None = None, tls: TlsFiles | None = None) -> None:
        """Create the channel (connection is lazy: nothing happens until the first call).

        Args:
            target: ``host:port``.
            token: Bearer token sent as ``authorization`` metadata.
            tls: Use TLS with these files (``TlsFiles()``: the system's root certificates); None
                speaks plain text.
        """
        self._target = target
        self._tls = tls is not None
        if tls is not None:
            self._channel = grpc.secure_channel(target, channel_credentials(tls), _CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, _CHANNEL_OPTIONS)
        self._stub = CoordinatorStub(self._channel)
        self._metadata = _auth_metadata(token)

    def _call(self, method: Callable[..., Any], request: Any, timeout: float) -> Any:
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            call: Any = err  # sync stubs raise objects that are both RpcError and Call
            raise error_from_rpc(
                call.code(), call.details(), call.trailing_metadata(), self._target, self._tls
            ) from None
        except ValueError as err:  # grpc's answer to a call on a closed channel
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None

    def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter:
        return convert.opened_from_pb(
            self._call(self._stub.OpenWriter, convert.open_writer_request(spec), timeout)
        )

    def keep_alive(self, handle: str, timeout: float) -> float:
        return convert.lease_ttl_from_pb(
            self._call(self._stub.KeepAlive, convert.keep_alive_request(handle), timeout)
        )

    def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts:
        request = convert.apply_deltas_request(handle, deltas, batch_seq)
        return convert.apply_counts_from_pb(self._call(self._stub.ApplyDeltas, request, timeout))

    def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]:
        request = convert.are_completed_request(checkpoint, source_ids)
        return convert.completed_from_pb(self._call(self._stub.AreCompleted, request, timeout))

    def flush(self, handle: str, timeout: float) -> int:
        return convert.flushed_from_pb(self._call(self._stub.Flush, convert.flush_request(handle), timeout))

    def close_writer(self, handle: str, timeout: float) -> CloseResult:
        return convert.close_result_from_pb(
            self._call(self._stub.CloseWriter, convert.close_writer_request(handle), timeout)
        )

    def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus:
        return convert.checkpoint_from_pb(
            self._call(self._stub.GetCheckpoint, convert.get_checkpoint_request(name), timeout)
        )

    def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]:
        return convert.checkpoints_from_pb(
            self._call(self._stub.ListCheckpoints, convert.list_checkpoints_request(), timeout)
        )

    def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]:
        request = convert.list_writers_request(checkpoint, include_closed, limit)
        return convert.writers_from_pb(self._call(self._stub.ListWriters, request, timeout))

    def list_events(self, checkpoint: str, limit: int, before_id: int | None, timeout: float) -> EventPage:
        request = convert.list_events_request(checkpoint, limit, before_id)
        return convert.event_page_from_pb(self._call(self._stub.ListEvents, request, timeout))

    def get_progress(self, checkpoint: str, since: float | None, timeout: float) -> list[ProgressSample]:
        request = convert.get_progress_request(checkpoint, since)
        return convert.progress_from_pb(self._call(self._stub.GetProgress, request, timeout))

    def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        request = convert.list_completed_request(checkpoint, after, limit)
        return convert.completed_page_from_pb(self._call(self._stub.ListCompleted, request, timeout))

    def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult:
        request = convert.import_completed_request(checkpoint, source_ids, import_id)
        return convert.import_result_from_pb(self._call(self._stub.ImportCompleted, request, timeout))

    def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult:
        request = convert.reset_request(name, force)
        return convert.reset_result_from_pb(self._call(self._stub.ResetCheckpoint, request, timeout))

    def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> Generator[CheckpointStatus, None, None]:
        # No deadline on the call: it would end the stream, not bound the connect. Without
        # wait_for_ready an unreachable server still fails at once with UNAVAILABLE.
        request = convert.watch_request(checkpoint, interval_ms)
        try:
            call: Any = self._stub.WatchCheckpoint(request, metadata=self._metadata)
        except ValueError as err:
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None
        try:
            for msg in call:
                yield convert.checkpoint_from_pb(msg)
        except grpc.RpcError as err:
            failed: Any = err
            raise error_from_rpc(
                failed.code(), failed.details(), failed.trailing_metadata(), self._target, self._tls
            ) from None
        except ValueError as err:
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()


class AsyncGrpcTransport:
    """asyncio transport over a ``grpc.aio.Channel``."""

    def __init__(self, target: str, *, token: str | None = None, tls: TlsFiles | None = None) -> None:
        """Remember where to connect; the channel is created on first use.

        A grpc.aio channel binds to the event loop that is running when it is created, and
        ``AsyncClient`` may be constructed outside any loop, so creation waits for the first call.
        The credentials (``tls``, see :class:`GrpcTransport`) are bound to no loop: made now, so
        an unreadable file fails here.
        """
        self._target = target
        self._tls = tls is not None
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._metadata = _auth_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    def _get_stub(self) -> Any:
        if self._stub is None:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, _CHANNEL_OPTIONS)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, _CHANNEL_OPTIONS)
            self._stub = CoordinatorStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: Any, timeout: float) -> Any:
        rpc: Callable[..., Awaitable[Any]] = getattr(self._get_stub(), method)
        try:
            return await rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(
                err.code(), err.details(), err.trailing_metadata(), self._target, self._tls
            ) from None
        except grpc.aio.UsageError as err:  # e.g. the channel was closed
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None

    async def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter:
        reply = await self._call("OpenWriter", convert.open_writer_request(spec), timeout)
        return convert.opened_from_pb(reply)

    async def keep_alive(self, handle: str, timeout: float) -> float:
        reply = await self._call("KeepAlive", convert.keep_alive_request(handle), timeout)
        return convert.lease_ttl_from_pb(reply)

    async def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts:
        request = convert.apply_deltas_request(handle, deltas, batch_seq)
        return convert.apply_counts_from_pb(await self._call("ApplyDeltas", request, timeout))

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]:
        request = convert.are_completed_request(checkpoint, source_ids)
        return convert.completed_from_pb(await self._call("AreCompleted", request, timeout))

    async def flush(self, handle: str, timeout: float) -> int:
        reply = await self._call("Flush", convert.flush_request(handle), timeout)
        return convert.flushed_from_pb(reply)

    async def close_writer(self, handle: str, timeout: float) -> CloseResult:
        reply = await self._call("CloseWriter", convert.close_writer_request(handle), timeout)
        return convert.close_result_from_pb(reply)

    async def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus:
        reply = await self._call("GetCheckpoint", convert.get_checkpoint_request(name), timeout)
        return convert.checkpoint_from_pb(reply)

    async def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]:
        reply = await self._call("ListCheckpoints", convert.list_checkpoints_request(), timeout)
        return convert.checkpoints_from_pb(reply)

    async def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]:
        request = convert.list_writers_request(checkpoint, include_closed, limit)
        return convert.writers_from_pb(await self._call("ListWriters", request, timeout))

    async def list_events(
        self, checkpoint: str, limit: int, before_id: int | None, timeout: float
    ) -> EventPage:
        request = convert.list_events_request(checkpoint, limit, before_id)
        return convert.event_page_from_pb(await self._call("ListEvents", request, timeout))

    async def get_progress(
        self, checkpoint: str, since: float | None, timeout: float
    ) -> list[ProgressSample]:
        request = convert.get_progress_request(checkpoint, since)
        return convert.progress_from_pb(await self._call("GetProgress", request, timeout))

    async def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        request = convert.list_completed_request(checkpoint, after, limit)
        return convert.completed_page_from_pb(await self._call("ListCompleted", request, timeout))

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult:
        request = convert.import_completed_request(checkpoint, source_ids, import_id)
        return convert.import_result_from_pb(await self._call("ImportCompleted", request, timeout))

    async def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult:
        request = convert.reset_request(name, force)
        return convert.reset_result_from_pb(await self._call("ResetCheckpoint", request, timeout))

    async def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> AsyncGenerator[CheckpointStatus, None]:
        # See GrpcTransport.watch for why the call has no deadline.
        request = convert.watch_request(checkpoint, interval_ms)
        try:
            call: Any = self._get_stub().WatchCheckpoint(request, metadata=self._metadata)
        except grpc.aio.UsageError as err:
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None
        try:
            async for msg in call:
                yield convert.checkpoint_from_pb(msg)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(
                err.code(), err.details(), err.trailing_metadata(), self._target, self._tls
            ) from None
        except grpc.aio.UsageError as err:
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(None)
