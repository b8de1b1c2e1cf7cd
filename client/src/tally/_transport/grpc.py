"""gRPC transports (blocking and grpc.aio) over the generated ``tally.v1`` stub.

Each has one ``send``: the call description's route (``grpc_convert.ROUTES``) picks the stub's
bound method, builds the request and reads the reply; this module only adds the channel, the
bearer token and the translation of gRPC errors.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Generator, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import grpc.aio

from tally._calls import Call, WatchCheckpoint
from tally._config import read_pem
from tally._transport import grpc_convert as convert
from tally._transport.base import TlsFiles
from tally._transport.contact import FirstContact
from tally._types import CheckpointStatus
from tally.errors import StatusCode, TallyError, Unavailable, error_for_code
from tally.v1.coordinator_pb2_grpc import CoordinatorStub

if TYPE_CHECKING:  # a typing-only class of the generated stubs
    from tally.v1.coordinator_pb2_grpc import CoordinatorAsyncStub

T = TypeVar("T")

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
# The google.rpc.Status a server sends with an error (grpcio-status); the transport never makes one.
STATUS_DETAILS_KEY = "grpc-status-details-bin"

# Checkpoint listings can be large (one entry per writer); lift gRPC's 4 MB receive default.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # A coordinator that restarts (an upgrade, a crash) is back in seconds; gRPC's default reconnect
    # backoff grows to two minutes, long enough for a writer's lease to run out meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel_options(authority: str | None) -> list[tuple[str, Any]]:
    """The channel's options; ``authority``: the ``host:port`` of the DNS name an address was found
    under (``tally._transport.dns``), sent as the calls' authority, which is also the name TLS
    checks the certificate against (instead of the address)."""
    options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    return options


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


# gRPC's words for a connection that was open and broke (a server killed in the middle of a call).
_BROKEN = ("Stream removed", "Socket closed", "Connection reset", "Broken pipe")


def _failure(
    contact: FirstContact, code: grpc.StatusCode | None, message: str | None, metadata: Any, tls: bool
) -> TallyError:
    """:func:`error_from_rpc`, remembering in ``contact`` whether the coordinator answered: a
    refused connection before it ever did is :class:`~tally._transport.contact.NeverReached`. An
    UNAVAILABLE the coordinator sent itself (its status in the trailers: a shard moving, an owner
    out of reach, a shutdown) is an answer: a refusal after it is an outage, retried."""
    error = error_from_rpc(code, message, metadata, contact.where, tls)
    if code is grpc.StatusCode.UNAVAILABLE and isinstance(error, Unavailable) and not _refusal(metadata):
        if any(sign in (message or "") for sign in _BROKEN):
            return contact.broke(error)
        return contact.failed(error, refused="Connection refused" in (message or ""))
    if code is not grpc.StatusCode.DEADLINE_EXCEEDED:
        contact.ok()  # any other status is the coordinator's answer
    return error


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


def _refusal(metadata: Any) -> bool:
    """Whether an error's trailers carry a coordinator's own status (a refusal it sent, such as
    "moving" or "restarting"): the coordinator is there, whatever the code, so it was reached."""
    return any(key in (STATUS_DETAILS_KEY, DETAILS_METADATA_KEY) for key, _ in _pairs(metadata))


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

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        connect_wait: float = 0.0,
        authority: str | None = None,
    ) -> None:
        """Create the channel (connection is lazy: nothing happens until the first call).

        Args:
            target: ``host:port``.
            token: Bearer token sent as ``authorization`` metadata.
            tls: Use TLS with these files (``TlsFiles()``: the system's root certificates); None
                speaks plain text.
            connect_wait: Seconds during which a refused first connection is retried (see
                ``tally._transport.contact``).
            authority: The ``host:port`` to send as the calls' authority, and whose certificate to
                expect with TLS, instead of ``target``.
        """
        self._target = target
        self._tls = tls is not None
        options = channel_options(authority)
        if tls is not None:
            self._channel = grpc.secure_channel(target, channel_credentials(tls), options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = CoordinatorStub(self._channel)
        self._metadata = _auth_metadata(token)
        self._contact = FirstContact(target, connect_wait)

    def send(self, call: Call[T], timeout: float) -> T:
        route = convert.route(call)
        try:
            reply = route.rpc(self._stub)(route.request(call), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            failed = cast(grpc.Call, err)  # sync stubs raise objects that are both RpcError and Call
            raise _failure(
                self._contact, failed.code(), failed.details(), failed.trailing_metadata(), self._tls
            ) from None
        except ValueError as err:  # grpc's answer to a call on a closed channel
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None
        self._contact.ok()
        return route.read(reply)

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        # No deadline on the call: it would end the stream, not bound the connect. Without
        # wait_for_ready an unreachable server still fails at once with UNAVAILABLE.
        try:
            stream = self._stub.WatchCheckpoint(convert.watch_request(call), metadata=self._metadata)
        except ValueError as err:
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None
        try:
            for msg in stream:
                self._contact.ok()
                yield convert.checkpoint_from_pb(msg)
        except grpc.RpcError as err:
            failed = cast(grpc.Call, err)
            raise _failure(
                self._contact, failed.code(), failed.details(), failed.trailing_metadata(), self._tls
            ) from None
        except ValueError as err:
            raise Unavailable(f"gRPC channel to {self._target} is closed: {err}") from None
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves RpcContext.cancel untyped

    def close(self) -> None:
        self._channel.close()


class AsyncGrpcTransport:
    """asyncio transport over a ``grpc.aio.Channel``."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        connect_wait: float = 0.0,
        authority: str | None = None,
    ) -> None:
        """Remember where to connect; the channel is created on first use.

        A grpc.aio channel binds to the event loop that is running when it is created, and
        ``AsyncClient`` may be constructed outside any loop, so creation waits for the first call.
        The credentials (``tls``, see :class:`GrpcTransport`) are bound to no loop: made now, so
        an unreadable file fails here.
        """
        self._target = target
        self._tls = tls is not None
        self._options = channel_options(authority)
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._metadata = _auth_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: CoordinatorAsyncStub | None = None
        self._contact = FirstContact(target, connect_wait)

    def _get_stub(self) -> CoordinatorAsyncStub:
        if self._stub is None:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, self._options)
            self._stub = CoordinatorStub(self._channel)
        return self._stub

    async def send(self, call: Call[T], timeout: float) -> T:
        route = convert.route(call)
        try:
            # The route picks the method on the stub class; on an aio channel it is the aio method.
            rpc = cast("grpc.aio.UnaryUnaryMultiCallable[Any, Any]", route.rpc(self._get_stub()))
            reply = await rpc(route.request(call), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise _failure(
                self._contact, err.code(), err.details(), err.trailing_metadata(), self._tls
            ) from None
        except grpc.aio.UsageError as err:  # e.g. the channel was closed
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None
        self._contact.ok()
        return route.read(reply)

    async def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]:
        # See GrpcTransport.watch for why the call has no deadline.
        try:
            stream = self._get_stub().WatchCheckpoint(convert.watch_request(call), metadata=self._metadata)
        except grpc.aio.UsageError as err:
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None
        try:
            async for msg in stream:
                self._contact.ok()
                yield convert.checkpoint_from_pb(msg)
        except grpc.aio.AioRpcError as err:
            raise _failure(
                self._contact, err.code(), err.details(), err.trailing_metadata(), self._tls
            ) from None
        except grpc.aio.UsageError as err:
            raise Unavailable(f"gRPC channel to {self._target} is unusable: {err}") from None
        finally:
            stream.cancel()

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(None)
