"""HTTP/JSON transports over the coordinator's REST API (``/v1``), stdlib only.

Each has one ``send``: the call description's route (``http_convert.ROUTES``) gives the method,
path and body and reads the answer; this module only adds the connection, headers and errors.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Generator
from typing import Any, TypeVar

from tally._calls import Call, WatchCheckpoint
from tally._transport import http_convert as convert
from tally._transport.base import TlsFiles
from tally._transport.contact import FirstContact
from tally._transport.http_errors import error_from_response, parse, ssl_context, tls_hint
from tally._transport.sse import EventStream
from tally._types import CheckpointStatus
from tally.errors import Internal, StatusCode, Unavailable

_USER_AGENT = "tally-python"

T = TypeVar("T")


class HttpTransport:
    """Blocking transport over the HTTP/JSON API using ``urllib.request``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        connect_wait: float = 0.0,
    ) -> None:
        """Create the transport.

        Args:
            base_url: ``http[s]://host:port[/prefix]``; ``/v1/...`` is appended.
            token: Bearer token sent as the ``Authorization`` header.
            tls: For ``https``: the CA to trust and a client certificate (None: system defaults).

        Raises:
            ValueError: A TLS file is not a usable certificate or key.
        """
        self._base = base_url.rstrip("/")
        self._headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._context = ssl_context(tls) if tls is not None else None
        handlers = [urllib.request.HTTPSHandler(context=self._context)] if self._context is not None else []
        self._opener = urllib.request.build_opener(*handlers)
        self._contact = FirstContact(self._base, connect_wait)

    def send(self, call: Call[T], timeout: float) -> T:
        route = convert.route(call)
        body = self._request(route.method, route.path(call), route.body(call), timeout)
        return parse(route.read, body, call.what)

    def _request(self, method: str, path: str, body: Any, timeout: float) -> Any:
        url = self._base + path
        headers = dict(self._headers)
        data = None
        if body is not None or method == "POST":
            data = json.dumps({} if body is None else body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            self._contact.ok()
            with err:
                raise error_from_response(err.code, err.read(), url) from None
        except urllib.error.URLError as err:
            code = StatusCode.DEADLINE_EXCEEDED if isinstance(err.reason, TimeoutError) else None
            hint = tls_hint(err.reason, self._base.startswith("https:"))
            unreachable = Unavailable(
                f"Tally coordinator at {self._base} is unreachable: {err.reason}{hint}", code
            )
            refused = isinstance(err.reason, ConnectionRefusedError)
            raise self._contact.failed(unreachable, refused=refused) from None
        except TimeoutError:
            raise Unavailable(
                f"Tally coordinator at {self._base} did not answer {method} {path} within {timeout:g}s",
                StatusCode.DEADLINE_EXCEEDED,
            ) from None
        except (http.client.HTTPException, OSError) as err:
            hint = tls_hint(err, self._base.startswith("https:"))
            failed = Unavailable(f"connection to Tally coordinator at {self._base} failed: {err!r}{hint}")
            raise self._contact.failed(failed, refused=isinstance(err, ConnectionRefusedError)) from None
        self._contact.ok()
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise Internal(f"{method} {url} answered with a body that is not JSON: {raw[:200]!r}") from None

    def event_stream(self, call: WatchCheckpoint, timeout: float) -> EventStream:
        """An unopened Server-Sent Events stream of the checkpoint's status."""
        return EventStream(
            self._base, convert.watch_path(call), self._headers, timeout, self._context, self._contact
        )

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        stream = self.event_stream(call, timeout)
        try:
            stream.open()
            yield from stream
        finally:
            stream.close()

    def close(self) -> None:
        self._opener.close()


class AsyncHttpTransport:
    """asyncio transport that runs :class:`HttpTransport` calls in worker threads."""

    def __init__(self, sync: HttpTransport) -> None:
        """Wrap a blocking HTTP transport.

        Args:
            sync: The transport whose calls run via ``asyncio.to_thread``.
        """
        self._sync = sync

    async def send(self, call: Call[T], timeout: float) -> T:
        return await asyncio.to_thread(self._sync.send, call, timeout)

    async def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]:
        stream = self._sync.event_stream(call, timeout)
        try:
            await asyncio.to_thread(stream.open)
            while True:
                # Each read blocks a worker thread; if this task is cancelled meanwhile, the
                # close below shuts the socket down and that thread's read ends too.
                status = await asyncio.to_thread(next, stream, None)
                if status is None:
                    return
                yield status
        finally:
            stream.close()

    async def close(self) -> None:
        self._sync.close()
