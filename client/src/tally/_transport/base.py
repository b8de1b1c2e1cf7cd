"""The one interface between the SDK and the wire, and the factory that picks an implementation.

Clients and writers speak only to a ``Transport`` / ``AsyncTransport``: ``send`` takes any call
description (``tally._calls``) and returns its answer, so adding an operation adds a description
and one entry per wire converter, never a method per transport class. The address scheme chooses
the implementation once, in :func:`make_transport` / :func:`make_async_transport`.
Implementations raise only :class:`tally.TallyError` subclasses, never wire-library errors.
Every send takes an explicit ``timeout`` in seconds for that single attempt; retrying is the
caller's business (``tally._retry.send``). The one streaming call, ``watch``, returns a generator
at once; its ``timeout`` bounds connecting where the wire allows it, never the stream's lifetime,
and closing the generator ends the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tally._calls import Call, WatchCheckpoint
from tally._config import ClientConfig, read_pem
from tally._types import CheckpointStatus

T = TypeVar("T")


class Transport(Protocol):
    """Blocking transport: one way to send any call description, one way to open the stream."""

    def send(self, call: Call[T], timeout: float) -> T:
        """One attempt at ``call`` within ``timeout`` seconds; its answer, read as ``call`` says."""
        ...

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        """Status snapshots as the server sends them; ends when the server ends the stream."""
        ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """asyncio transport: the same two paths as :class:`Transport`, awaitable."""

    async def send(self, call: Call[T], timeout: float) -> T: ...

    def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]: ...

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
        from tally._transport.grpc import GrpcTransport

        return GrpcTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))
    from tally._transport.http import HttpTransport

    return HttpTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))


def make_async_transport(config: ClientConfig) -> AsyncTransport:
    """Create the asyncio transport for ``config.address`` (see :func:`make_transport`)."""
    endpoint = parse_address(config.address)
    if endpoint.scheme == "grpc":
        from tally._transport.grpc import AsyncGrpcTransport

        return AsyncGrpcTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint))
    from tally._transport.http import AsyncHttpTransport, HttpTransport

    return AsyncHttpTransport(HttpTransport(endpoint.target, token=config.token, tls=_tls(config, endpoint)))
