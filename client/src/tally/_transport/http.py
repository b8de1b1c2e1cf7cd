"""HTTP/JSON transports over the coordinator's REST API (``/v1``), on httpx (``tally-client[http]``).

Each has one ``send``: the call description's route (``http_convert.ROUTES``) gives the method,
path and body and reads the answer; this module only adds the client, headers and errors. Each
transport owns one httpx client, so its calls share a pool of keep-alive connections (a call
opens no new TCP connection, nor TLS session, while one is idle), and closing the transport
closes them. The asyncio transport is httpx's own ``AsyncClient``: no threads.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
from collections.abc import AsyncGenerator, Generator
from typing import Any, TypeVar

import httpx

from tally._calls import Call, WatchCheckpoint
from tally._transport import http_convert as convert
from tally._transport.base import TlsFiles
from tally._transport.contact import FirstContact
from tally._transport.http_errors import error_from_response, parse, ssl_context, unreachable
from tally._transport.sse import EventStream, async_events
from tally._types import CheckpointStatus
from tally.errors import Internal

_USER_AGENT = "tally-python"

# Idle connections are kept for a writer's next heartbeat (every lease / 3: 10 s by default), so
# a process with one writer does not connect (and, with TLS, shake hands) again for each beat:
# 300 such writers over HTTPS cost the server 7.2-7.5 % of a core at 30 s against 10.4-10.8 % at
# the 3 s this was before. They are dropped before the coordinator's own keep-alive timeout ends
# them (TALLY_HTTP_KEEPALIVE_S, 75 s by default) and before an AWS ALB's 60 s, so a request seldom
# goes out on a connection the server is closing; one that does (a proxy in front that keeps
# connections for less) fails as Unavailable, which the caller's retry layer resends.
_KEEPALIVE_EXPIRY_S = 30.0
# No cap on connections: each open watch holds one, and a capped pool would make further calls
# wait for a stream to end. Idle ones beyond this many are closed.
_LIMITS = httpx.Limits(
    max_connections=None, max_keepalive_connections=20, keepalive_expiry=_KEEPALIVE_EXPIRY_S
)

T = TypeVar("T")


def _client_options(token: str | None, tls: TlsFiles | None, authority: str | None) -> dict[str, Any]:
    """The settings both httpx clients share: headers, TLS, pool limits.

    ``authority``: the ``host[:port]`` to send as ``Host`` instead of the URL's (the DNS name an
    address was found under, ``tally._transport.dns``).

    Raises:
        ValueError: A TLS file is not a usable certificate or key.
    """
    headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if authority is not None:
        headers["Host"] = authority
    return {
        "headers": headers,
        # https: the CA and client pair of ``tls`` (system roots without a CA file).
        "verify": ssl_context(tls) if tls is not None else _plain_http_context(),
        "limits": _LIMITS,
    }


def _with_server_name(request: httpx.Request, server_name: str) -> None:
    """Check the certificate of ``server_name`` (and ask for it by SNI), not the URL's address's."""
    request.extensions["sni_hostname"] = server_name


def _server_name_hooks(server_name: str | None, tls: TlsFiles | None, *, aio: bool) -> dict[str, Any]:
    """The event hooks that make every request of an https client present ``server_name``."""
    if server_name is None or tls is None:
        return {}
    if aio:

        async def hook(request: httpx.Request) -> None:
            _with_server_name(request, server_name)

        return {"event_hooks": {"request": [hook]}}
    return {"event_hooks": {"request": [functools.partial(_with_server_name, server_name=server_name)]}}


@functools.cache
def _plain_http_context() -> ssl.SSLContext:
    """The TLS settings of an http:// transport, which speaks no TLS to its coordinator but whose
    httpx client wants some (an https proxy of the environment would use them): the system's
    defaults, made once per process, as reading the trust store takes tens of milliseconds."""
    return ssl.create_default_context()


def _request_args(call: Call[Any]) -> tuple[str, str, dict[str, Any]]:
    """Method, path and httpx keyword arguments (the JSON body and its type) of ``call``."""
    route = convert.route(call)
    body = route.body(call)
    kwargs: dict[str, Any] = {}
    if body is not None or route.method == "POST":
        kwargs["content"] = (
            body if isinstance(body, bytes) else json.dumps({} if body is None else body).encode()
        )
        kwargs["headers"] = {"Content-Type": "application/json"}
    return route.method, route.path(call), kwargs


def _answer(call: Call[T], response: httpx.Response, url: str) -> T:
    """The answer of ``call`` read from ``response``, or the error it carries."""
    if response.status_code >= 300:
        raise error_from_response(response.status_code, response.content, url)
    raw = response.content
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        raise Internal(
            f"{response.request.method} {url} answered with a body that is not JSON: {raw[:200]!r}"
        ) from None
    return parse(convert.route(call).read, body, call.what)


class HttpTransport:
    """Blocking transport over the HTTP/JSON API: one ``httpx.Client`` and its connection pool."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        connect_wait: float = 0.0,
        authority: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """Create the transport; no connection is made until the first call.

        Args:
            base_url: ``http[s]://host:port[/prefix]``; ``/v1/...`` is appended.
            token: Bearer token sent as the ``Authorization`` header.
            tls: For ``https``: the CA to trust and a client certificate (None: system defaults).
            connect_wait: Seconds during which a refused first connection is retried (see contact).
            authority: The ``host[:port]`` to send as ``Host`` instead of the URL's.
            server_name: The host whose certificate to expect instead of the URL's (https).

        Raises:
            ValueError: A TLS file is not a usable certificate or key.
        """
        self._base = base_url.rstrip("/")
        hooks = _server_name_hooks(server_name, tls, aio=False)
        self._options = _client_options(token, tls, authority) | hooks
        self._client = httpx.Client(**self._options)
        self._pid = os.getpid()
        self._contact = FirstContact(self._base, connect_wait)

    def _pool(self) -> httpx.Client:
        """The client of this process: a forked child gets a new pool, as its parent's connections
        (copied by fork, still the parent's) would carry the two processes' requests interleaved.
        The copy is dropped unclosed: closing it would end the parent's connections too."""
        if os.getpid() != self._pid:
            self._client = httpx.Client(**self._options)
            self._pid = os.getpid()
        return self._client

    def send(self, call: Call[T], timeout: float) -> T:
        method, path, kwargs = _request_args(call)
        url = self._base + path
        try:
            response = self._pool().request(method, url, timeout=timeout, **kwargs)
        except httpx.HTTPError as err:
            raise unreachable(err, self._base, f"{method} {path}", timeout, self._contact) from None
        self._contact.ok()
        return _answer(call, response, url)

    def event_stream(self, call: WatchCheckpoint, timeout: float) -> EventStream:
        """An unopened Server-Sent Events stream of the checkpoint's status."""
        return EventStream(self._pool(), self._base, convert.watch_path(call), timeout, self._contact)

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        stream = self.event_stream(call, timeout)
        try:
            stream.open()
            yield from stream
        finally:
            stream.close()

    def close(self) -> None:
        """Close the pool's connections (in a forked child that made no call: leave the parent's)."""
        if os.getpid() == self._pid:
            self._client.close()


class AsyncHttpTransport:
    """asyncio transport over the HTTP/JSON API: one ``httpx.AsyncClient`` and its connection pool.

    Its calls run on the caller's event loop, concurrently, without threads.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        connect_wait: float = 0.0,
        authority: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """Create the transport (no connection yet); the arguments are :class:`HttpTransport`'s.

        Raises:
            ValueError: A TLS file is not a usable certificate or key.
        """
        self._base = base_url.rstrip("/")
        hooks = _server_name_hooks(server_name, tls, aio=True)
        self._options = _client_options(token, tls, authority) | hooks
        self._client = httpx.AsyncClient(**self._options)
        self._pid = os.getpid()
        self._contact = FirstContact(self._base, connect_wait)

    def _pool(self) -> httpx.AsyncClient:
        """The client of this process (see :meth:`HttpTransport._pool`)."""
        if os.getpid() != self._pid:
            self._client = httpx.AsyncClient(**self._options)
            self._pid = os.getpid()
        return self._client

    async def send(self, call: Call[T], timeout: float) -> T:
        method, path, kwargs = _request_args(call)
        url = self._base + path
        try:
            response = await self._pool().request(method, url, timeout=timeout, **kwargs)
        except httpx.HTTPError as err:
            raise unreachable(err, self._base, f"{method} {path}", timeout, self._contact) from None
        self._contact.ok()
        return _answer(call, response, url)

    def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]:
        return async_events(self._pool(), self._base, convert.watch_path(call), timeout, self._contact)

    async def close(self) -> None:
        """Close the pool's connections (see :meth:`HttpTransport.close`)."""
        if os.getpid() == self._pid:
            await self._client.aclose()
