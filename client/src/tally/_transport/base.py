"""The one interface between the SDK and the wire, and the factory that picks an implementation.

Clients and writers speak only to a ``Transport`` / ``AsyncTransport``: ``send`` takes any call
description (``tally._calls``) and returns its answer, so adding an operation adds a description
and one entry per wire converter, never a method per transport class. The address scheme chooses
the implementation once, in :func:`make_transport` / :func:`make_async_transport`; an address
listing several coordinator replicas, or naming a host whose DNS name has several records
(``tally._transport.dns``), gets one transport per replica behind a failover transport
(``tally._transport.failover``); a single address gets its transport alone.
Implementations raise only :class:`tally.TallyError` subclasses, never wire-library errors.
Every send takes an explicit ``timeout`` in seconds for that single attempt; retrying is the
caller's business (``tally._retry.send``). The one streaming call, ``watch``, returns a generator
at once; its ``timeout`` bounds connecting where the wire allows it, never the stream's lifetime,
and closing the generator ends the stream.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tally._calls import Call, WatchCheckpoint
from tally._config import ClientConfig, read_pem
from tally._types import CheckpointStatus

T = TypeVar("T")
Tr = TypeVar("Tr")  # a replica's transport (blocking or asyncio)


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
    """A parsed address: which wire to speak, where, and whether over TLS.

    An endpoint found under a DNS name of several records (``tally._transport.dns``) has one of
    the name's addresses in ``target`` and the name itself in ``authority`` (``host[:port]`` as
    the user wrote it: the gRPC authority, whose host gRPC's TLS checks the certificate against,
    and the HTTP ``Host`` header) and ``server_name`` (the host HTTPS asks for by SNI and checks).
    """

    scheme: str  # "grpc" or "http"
    target: str  # gRPC target "host:port", or HTTP base URL without trailing slash
    tls: bool
    authority: str | None = None
    server_name: str | None = None


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


def parse_addresses(address: str) -> list[Endpoint]:
    """Parse one address, or a comma-separated list of coordinator replicas' addresses.

    A list must speak one wire (all gRPC: ``host:port``, ``grpc://``, ``grpcs://``; or all HTTP:
    ``http://``, ``https://``) and use TLS for every replica or for none: the token and TLS files
    of a client apply to all of them.

    Raises:
        ValueError: An element is empty or cannot be parsed, or the list mixes wires or TLS.
    """
    parts = address.split(",")
    if len(parts) == 1:
        return [parse_address(address)]
    for position, part in enumerate(parts, 1):
        if not part.strip():
            raise ValueError(
                f"address list {address!r} has an empty element (number {position}); separate "
                "replicas with single commas and no trailing comma, e.g. h1:50051,h2:50051"
            )
    endpoints = [parse_address(part) for part in parts]
    first, first_text = endpoints[0], parts[0].strip()
    for endpoint, part in zip(endpoints[1:], parts[1:], strict=True):
        if endpoint.scheme != first.scheme:
            raise ValueError(
                f"address list {address!r} mixes gRPC and HTTP: {first_text!r} is {_WIRE[first.scheme]} "
                f"but {part.strip()!r} is {_WIRE[endpoint.scheme]}; list every replica on one wire, "
                "e.g. h1:50051,h2:50051 or http://h1:8080,http://h2:8080"
            )
        if endpoint.tls != first.tls:
            raise ValueError(
                f"address list {address!r} mixes TLS and plain text: {first_text!r} and "
                f"{part.strip()!r}; use grpcs:// (or https://) for every replica, or for none"
            )
    return endpoints


_WIRE = {"grpc": "gRPC", "http": "HTTP"}


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
    """Create the blocking transport for ``config.address`` (one per replica if it lists several).

    Implementations are imported here, lazily, so ``import tally`` stays cheap, an HTTP-only
    user never loads grpc and a gRPC user never loads httpx (the ``tally-client[http]`` extra).

    Raises:
        ValueError: The address cannot be parsed (see :func:`parse_addresses`), or a TLS file
            cannot be read.
        ModuleNotFoundError: An HTTP address, and httpx is not installed.
    """
    endpoints = parse_addresses(config.address)
    replicas = _replicas(endpoints)
    if len(replicas) == 1:
        return _one_transport(config, replicas[0])
    from tally._transport.failover import FailoverTransport

    return FailoverTransport(
        [(_name(e), _one_transport(config, e)) for e in replicas],
        lookup=_lookup(endpoints, replicas, lambda e: _one_transport(config, e)),
    )


def make_async_transport(config: ClientConfig) -> AsyncTransport:
    """Create the asyncio transport for ``config.address`` (see :func:`make_transport`)."""
    endpoints = parse_addresses(config.address)
    replicas = _replicas(endpoints)
    if len(replicas) == 1:
        return _one_async_transport(config, replicas[0])
    from tally._transport.failover import AsyncFailoverTransport

    return AsyncFailoverTransport(
        [(_name(e), _one_async_transport(config, e)) for e in replicas],
        lookup=_lookup(endpoints, replicas, lambda e: _one_async_transport(config, e)),
    )


def _replicas(endpoints: list[Endpoint]) -> list[Endpoint]:
    """``endpoints`` with each DNS name of several records replaced by one endpoint per address."""
    from tally._transport.dns import replicas_of

    return [replica for endpoint in endpoints for replica in replicas_of(endpoint)]


def _lookup(
    endpoints: list[Endpoint], replicas: list[Endpoint], make: Callable[[Endpoint], Tr]
) -> Callable[[], list[tuple[str, Callable[[], Tr]]]] | None:
    """How the failover transport looks the names up again (None: no name had several records)."""
    if replicas == endpoints:
        return None

    from tally._transport.dns import looked_up

    def lookup() -> list[tuple[str, Callable[[], Tr]]]:
        found = [looked_up(endpoint) for endpoint in endpoints]
        if any(replicas is None for replicas in found):
            return []  # a name could not be looked up now: keep the replicas known
        return [(_name(e), functools.partial(make, e)) for replicas in found for e in replicas or ()]

    return lookup


def _name(endpoint: Endpoint) -> str:
    """How logs name a replica: its URL (``grpc://`` for plain gRPC too, so none looks bare), and
    the DNS name it was found under, if any."""
    if endpoint.scheme == "http":
        name = endpoint.target
    else:
        name = f"{'grpcs' if endpoint.tls else 'grpc'}://{endpoint.target}"
    return name if endpoint.authority is None else f"{name} ({endpoint.authority})"


def _one_transport(config: ClientConfig, endpoint: Endpoint) -> Transport:
    if endpoint.scheme == "grpc":
        from tally._transport.grpc import GrpcTransport

        return GrpcTransport(
            endpoint.target,
            token=config.token,
            tls=_tls(config, endpoint),
            connect_wait=config.connect_wait,
            authority=endpoint.authority,
        )
    _require_httpx(endpoint)
    from tally._transport.http import HttpTransport

    return HttpTransport(
        endpoint.target,
        token=config.token,
        tls=_tls(config, endpoint),
        connect_wait=config.connect_wait,
        authority=endpoint.authority,
        server_name=endpoint.server_name,
    )


def _one_async_transport(config: ClientConfig, endpoint: Endpoint) -> AsyncTransport:
    if endpoint.scheme == "grpc":
        from tally._transport.grpc import AsyncGrpcTransport

        return AsyncGrpcTransport(
            endpoint.target,
            token=config.token,
            tls=_tls(config, endpoint),
            connect_wait=config.connect_wait,
            authority=endpoint.authority,
        )
    _require_httpx(endpoint)
    from tally._transport.http import AsyncHttpTransport

    return AsyncHttpTransport(
        endpoint.target,
        token=config.token,
        tls=_tls(config, endpoint),
        connect_wait=config.connect_wait,
        authority=endpoint.authority,
        server_name=endpoint.server_name,
    )


HTTP_EXTRA_HINT = "pip install 'tally-client[http]'"


def _require_httpx(endpoint: Endpoint) -> None:
    """The HTTP transports need httpx, the ``[http]`` extra: say so in one line when it is missing.

    Raises:
        ModuleNotFoundError: httpx is not installed.
    """
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError(
            f"the HTTP address {endpoint.target} needs httpx, which is not installed: {HTTP_EXTRA_HINT} "
            "(or use the coordinator's gRPC address, host:port, which needs nothing more)",
            name="httpx",
        ) from None
