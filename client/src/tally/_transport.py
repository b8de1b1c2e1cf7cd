"""The one interface between the SDK and the wire, and the factory that picks an implementation.

Clients and writers speak only to a ``Transport`` / ``AsyncTransport``; the address scheme
chooses the implementation once, in :func:`make_transport` / :func:`make_async_transport`.
Implementations raise only :class:`tally.TallyError` subclasses, never wire-library errors.
Every call takes an explicit ``timeout`` in seconds for that single attempt; retrying is the
caller's business. The one streaming call, ``watch``, returns a generator at once; its
``timeout`` bounds connecting where the wire allows it, never the stream's lifetime, and closing
the generator ends the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tally._config import ClientConfig, read_pem
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


class Transport(Protocol):
    """Blocking transport."""

    def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter: ...

    def keep_alive(self, handle: str, timeout: float) -> float:
        """Renew the lease; returns the lease TTL in seconds."""
        ...

    def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts: ...

    def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]: ...

    def flush(self, handle: str, timeout: float) -> int:
        """Server-side barrier; returns the writer's durable completions so far."""
        ...

    def close_writer(self, handle: str, timeout: float) -> CloseResult: ...

    def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus: ...

    def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]: ...

    def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]: ...

    def list_events(
        self, checkpoint: str, limit: int, before_id: int | None, timeout: float
    ) -> EventPage: ...

    def get_progress(self, checkpoint: str, since: float | None, timeout: float) -> list[ProgressSample]: ...

    def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        """Completed ids strictly after ``after`` in byte order, at most ``limit`` of them."""
        ...

    def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult: ...

    def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult: ...

    def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> Generator[CheckpointStatus, None, None]:
        """Status snapshots as the server sends them; ends when the server ends the stream."""
        ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """asyncio transport: the same operations as :class:`Transport`, awaitable."""

    async def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter: ...

    async def keep_alive(self, handle: str, timeout: float) -> float: ...

    async def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts: ...

    async def are_completed(
        self, checkpoint: str, source_ids: Sequence[str], timeout: float
    ) -> list[bool]: ...

    async def flush(self, handle: str, timeout: float) -> int: ...

    async def close_writer(self, handle: str, timeout: float) -> CloseResult: ...

    async def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus: ...

    async def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]: ...

    async def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]: ...

    async def list_events(
        self, checkpoint: str, limit: int, before_id: int | None, timeout: float
    ) -> EventPage: ...

    async def get_progress(
        self, checkpoint: str, since: float | None, timeout: float
    ) -> list[ProgressSample]: ...

    async def list_completed(
        self, checkpoint: str, after: str, limit: int, timeout: float
    ) -> CompletedPage: ...

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult: ...

    async def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult: ...

    def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> AsyncGenerator[CheckpointStatus, None]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Endpoint:
    """A parsed address: which wire to speak, where, and whether over TLS."""

    scheme: str  # "grpc" or "http"
    target: str  # gRPC target "host:port", or HTTP base URL without trailing slash
    tls: bool


_SCHEMES = {
    "grpc": ("grpc", False),
    "grpcs": ("grpc", True),
    "http": ("http", False),
    "https": ("http", True),
}


def parse_address(address: str) -> Endpoint:
    """Parse ``host:port``, ``grpc[s]://host:port`` or ``http[s]://host:port[/prefix]``.

    Raises:
        ValueError: Unknown scheme or missing host.
    """
    scheme, sep, rest = address.strip().partition("://")
    if not sep:
        scheme, rest = "grpc", address.strip()
    scheme = scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported address scheme {scheme!r} in {address!r}; "
            "use host:port, grpc://, grpcs://, http:// or https://"
        )
    wire, tls = _SCHEMES[scheme]
    rest = rest.rstrip("/")
    host = rest.split("/", 1)[0]
    if not host:
        raise ValueError(f"address {address!r} has no host; expected e.g. 127.0.0.1:50051")
    if wire == "grpc":
        if "/" in rest:
            raise ValueError(f"a gRPC address takes no path: {address!r}")
        return Endpoint("grpc", rest, tls)
    return Endpoint("http", f"{'https' if tls else 'http'}://{rest}", tls)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS connection: the CA to trust (None: the system's) and a client pair."""

    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None


def _tls(config: ClientConfig, endpoint: Endpoint) -> TlsFiles | None:
    """The TLS files of ``config``, checked now so a wrong path fails at construction; None: plain."""
    if not endpoint.tls:
        return None
    files = TlsFiles(config.ca_cert, config.client_cert, config.client_key)
    for what, path in vars(files).items():
        if path is not None:
            read_pem(what, path)
    return files


def make_transport(config: ClientConfig) -> Transport:
    """Create the blocking transport for ``config.address``.

    Implementations are imported here, lazily, so ``import tally`` stays cheap and an HTTP-only
    user never loads grpc.
    """
    endpoint = parse_address(config.address)
    if endpoint.scheme == "grpc":
        from tally._grpc import GrpcTransport

        return GrpcTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))
    from tally._http import HttpTransport

    return HttpTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))


def make_async_transport(config: ClientConfig) -> AsyncTransport:
    """Create the asyncio transport for ``config.address`` (see :func:`make_transport`)."""
    endpoint = parse_address(config.address)
    if endpoint.scheme == "grpc":
        from tally._grpc import AsyncGrpcTransport

        return AsyncGrpcTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))
    from tally._http import AsyncHttpTransport, HttpTransport

    return AsyncHttpTransport(HttpTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint)))
