"""Server-Sent Events over a plain ``http.client`` connection: the HTTP form of ``watch``."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator, Mapping

from tally._transport import http_convert as convert
from tally._transport.contact import FirstContact
from tally._transport.http_errors import error_from_response, parse, tls_hint
from tally._types import CheckpointStatus
from tally.errors import Internal, StatusCode, Unavailable


class EventStream:
    """A Server-Sent Events response read line by line over a plain ``http.client`` connection.

    ``urllib`` applies one socket timeout to every read, which would end a quiet stream; here the
    timeout bounds connecting and the response headers only. :meth:`close` may be called from
    another thread: it shuts the socket down, which wakes a read blocked in ``__next__``.
    """

    def __init__(
        self,
        base_url: str,
        path: str,
        headers: Mapping[str, str],
        timeout: float,
        context: ssl.SSLContext | None = None,
        contact: FirstContact | None = None,
    ) -> None:
        """Prepare the request; nothing is sent until :meth:`open`.

        Args:
            base_url: ``http[s]://host:port[/prefix]``.
            path: ``/v1/...`` with its query string.
            headers: Request headers (authorization included).
            timeout: Seconds for connecting and receiving the response headers.
            context: TLS settings for ``https``; None: the system's defaults.
            contact: The transport's memory of whether the coordinator ever answered (a refused
                first connection then fails at once); None: every failure may be retried.
        """
        self._contact = contact if contact is not None else FirstContact(base_url)
        parts = urllib.parse.urlsplit(base_url)
        self._base = base_url
        self.url = base_url + path
        self._target = parts.path.rstrip("/") + path
        self._headers = {**headers, "Accept": "text/event-stream", "Cache-Control": "no-cache"}
        self._conn: http.client.HTTPConnection
        if parts.scheme == "https":
            self._conn = http.client.HTTPSConnection(
                parts.hostname or "",
                parts.port,
                timeout=timeout,
                context=context if context is not None else ssl.create_default_context(),
            )
        else:
            self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        self._sock: socket.socket | None = None
        self._response: http.client.HTTPResponse | None = None
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> None:
        """Connect, send the request and check the response status.

        Raises:
            TallyError: The server refused (its error body is translated) or is unreachable.
        """
        base = self._base
        try:
            self._conn.connect()
            with self._lock:
                # Kept apart from the connection: http.client drops conn.sock when the
                # response says "Connection: close", and close() needs it to wake a reader.
                self._sock = self._conn.sock
            self._conn.request("GET", self._target, headers=self._headers)
            response = self._conn.getresponse()
        except TimeoutError:
            self.close()
            raise Unavailable(
                f"Tally coordinator at {base} did not answer GET {self._target}",
                StatusCode.DEADLINE_EXCEEDED,
            ) from None
        except (http.client.HTTPException, OSError) as err:
            self.close()
            hint = tls_hint(err, base.startswith("https:"))
            unreachable = Unavailable(f"Tally coordinator at {base} is unreachable: {err!r}{hint}")
            raise self._contact.failed(unreachable, refused=isinstance(err, ConnectionRefusedError)) from None
        self._contact.ok()
        if response.status != 200:
            body = response.read()
            self.close()
            raise error_from_response(response.status, body, self.url)
        if self._sock is not None:
            self._sock.settimeout(None)  # a quiet checkpoint sends nothing for a long time
        self._response = response

    def __iter__(self) -> Iterator[CheckpointStatus]:
        return self

    def __next__(self) -> CheckpointStatus:
        """The next event's status; StopIteration when the server ends the stream."""
        data: list[str] = []
        while True:
            line = self._readline()
            if line is None:
                raise StopIteration
            if not line:  # blank line: dispatch the event
                if data:
                    return self._status(data)
                continue
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value.removeprefix(" "))
            # Comments (":keepalive"), "event:", "id:" and "retry:" carry nothing Tally needs.

    def _readline(self) -> str | None:
        response = self._response
        if response is None or self._closed:
            return None
        try:
            raw = response.readline()
        except (http.client.HTTPException, OSError, ValueError) as err:
            if self._closed:
                return None
            raise Unavailable(f"event stream {self.url} broke: {err!r}") from None
        if not raw:
            return None
        return raw.decode("utf-8", "replace").rstrip("\r\n")

    def _status(self, data: list[str]) -> CheckpointStatus:
        try:
            payload = json.loads("\n".join(data))
        except ValueError:
            raise Internal(f"event stream {self.url} sent data that is not JSON: {data[:1]!r}") from None
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            # An error reported inside the stream, in the API's usual error shape.
            raise error_from_response(200, json.dumps(payload).encode(), self.url)
        return parse(convert.checkpoint_from_json, payload, "watch")

    def close(self) -> None:
        """End the stream; safe to call twice and from another thread."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
        self._conn.close()
