"""Server-Sent Events, the HTTP form of ``watch``: lines of a streamed httpx response -> statuses.

:class:`EventParser` turns lines into statuses and does no I/O; :class:`EventStream` (blocking)
and :func:`async_events` (asyncio) feed it from a response of the transport's connection pool.
The transport's ``timeout`` bounds connecting and the response headers only: once the stream is
open, reads wait without limit (a quiet checkpoint sends nothing for a long time).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx

from tally._transport import http_convert as convert
from tally._transport.contact import FirstContact
from tally._transport.http_errors import error_from_response, parse, unreachable
from tally._types import CheckpointStatus
from tally.errors import Internal, Unavailable

HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}


class EventParser:
    """Lines of an event stream in, one status per complete event out."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._data: list[str] = []

    def feed(self, line: str) -> CheckpointStatus | None:
        """Take one line (without its ending); the status when it completes an event, else None."""
        if not line:  # blank line: dispatch the event
            data, self._data = self._data, []
            return self._status(data) if data else None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        # Comments (":keepalive"), "event:", "id:" and "retry:" carry nothing Tally needs.
        return None

    def _status(self, data: list[str]) -> CheckpointStatus:
        try:
            payload = json.loads("\n".join(data))
        except ValueError:
            raise Internal(f"event stream {self.url} sent data that is not JSON: {data[:1]!r}") from None
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            # An error reported inside the stream, in the API's usual error shape.
            raise error_from_response(200, json.dumps(payload).encode(), self.url)
        return parse(convert.checkpoint_from_json, payload, "watch")


def _unbounded_reads(response: httpx.Response) -> None:
    """Lift the read timeout for the rest of ``response`` (its headers came within it).

    httpcore reads the request's ``timeout`` extension at every read of the body, so this one
    response waits for events without limit while the client's other requests keep theirs.
    """
    timeouts: dict[str, Any] = response.request.extensions.get("timeout", {})
    timeouts["read"] = None


def _request(client: httpx.Client | httpx.AsyncClient, url: str, timeout: float) -> httpx.Request:
    # Its timeout extension is a dict of its own, which _unbounded_reads changes once the headers are in.
    return client.build_request("GET", url, headers=HEADERS, timeout=timeout)


class EventStream:
    """A blocking Server-Sent Events response; :meth:`close` may be called from another thread
    (it shuts the socket down, which wakes a read blocked in ``__next__``)."""

    def __init__(
        self, client: httpx.Client, base: str, path: str, timeout: float, contact: FirstContact
    ) -> None:
        """Prepare the request; nothing is sent until :meth:`open`.

        Args:
            client: The transport's client (its pool, headers and TLS settings).
            base: ``http[s]://host:port[/prefix]``, for messages.
            path: ``/v1/watch?...``.
            timeout: Seconds for connecting and receiving the response headers.
            contact: The transport's memory of whether the coordinator ever answered.
        """
        self._client = client
        self._base = base
        self.url = base + path
        self._timeout = timeout
        self._contact = contact
        self._parser = EventParser(self.url)
        self._response: httpx.Response | None = None
        self._lines: Iterator[str] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> None:
        """Connect, send the request and check the response status.

        Raises:
            TallyError: The server refused (its error body is translated) or is unreachable.
        """
        request = _request(self._client, self.url, self._timeout)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as err:
            raise unreachable(err, self._base, f"GET {self.url}", self._timeout, self._contact) from None
        self._contact.ok()
        if response.status_code != 200:
            try:
                body = response.read()
            except httpx.HTTPError:
                body = b""
            response.close()
            raise error_from_response(response.status_code, body, self.url)
        _unbounded_reads(response)
        with self._lock:
            self._response = response
            closed = self._closed
        if closed:  # closed from another thread while opening
            response.close()
            return
        self._lines = response.iter_lines()

    def __iter__(self) -> Iterator[CheckpointStatus]:
        return self

    def __next__(self) -> CheckpointStatus:
        """The next event's status; StopIteration when the server ends the stream."""
        while True:
            line = self._readline()
            if line is None:
                raise StopIteration
            status = self._parser.feed(line)
            if status is not None:
                return status

    def _readline(self) -> str | None:
        if self._lines is None or self._closed:
            return None
        try:
            return next(self._lines, None)
        except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as err:
            if self._closed:
                return None
            raise Unavailable(f"event stream {self.url} broke: {err!r}") from None

    def close(self) -> None:
        """End the stream; safe to call twice and from another thread."""
        with self._lock:
            self._closed = True
            response, self._response = self._response, None
        if response is None:
            return
        # Closing a socket does not wake a thread blocked reading it; shutting it down does.
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
        response.close()


async def async_events(
    client: httpx.AsyncClient, base: str, path: str, timeout: float, contact: FirstContact
) -> AsyncGenerator[CheckpointStatus, None]:
    """The asyncio form of :class:`EventStream`: statuses until the server ends the stream.

    Closing the generator (or cancelling the task awaiting it) closes the response.
    """
    url = base + path
    request = _request(client, url, timeout)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as err:
        raise unreachable(err, base, f"GET {url}", timeout, contact) from None
    try:
        contact.ok()
        if response.status_code != 200:
            try:
                body = await response.aread()
            except httpx.HTTPError:
                body = b""
            raise error_from_response(response.status_code, body, url)
        _unbounded_reads(response)
        parser = EventParser(url)
        lines = response.aiter_lines()
        while True:
            try:
                line = await anext(lines, None)
            except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as err:
                raise Unavailable(f"event stream {url} broke: {err!r}") from None
            if line is None:
                return
            status = parser.feed(line)
            if status is not None:
                yield status
    finally:
        await response.aclose()
