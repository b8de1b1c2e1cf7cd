"""HTTP/JSON transports over the coordinator's REST API (``/v1``), stdlib only."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from tally import _convert as convert
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
from tally.errors import Internal, StatusCode, TallyError, Unavailable, error_for_code

# The one HTTP status -> SDK status table, used when the body carries no error code.
_STATUS: dict[int, StatusCode] = {
    400: StatusCode.INVALID_ARGUMENT,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.NOT_FOUND,
    405: StatusCode.UNIMPLEMENTED,
    409: StatusCode.ALREADY_EXISTS,
    412: StatusCode.FAILED_PRECONDITION,
    422: StatusCode.INVALID_ARGUMENT,  # FastAPI's request-validation status
    429: StatusCode.RESOURCE_EXHAUSTED,
    499: StatusCode.CANCELLED,
    500: StatusCode.INTERNAL,
    501: StatusCode.UNIMPLEMENTED,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.DEADLINE_EXCEEDED,
}

_USER_AGENT = "tally-python"

T = TypeVar("T")


def error_from_response(status: int, body: bytes, url: str) -> TallyError:
    """Translate an HTTP error response: by the body's ``error.code`` if present, else by status."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        try:
            code = StatusCode(str(error.get("code")))
        except ValueError:
            code = _status_code(status)
        message = str(error.get("message") or f"HTTP {status}")
        details = error.get("details")
        return error_for_code(code, message, details if isinstance(details, dict) else None)
    code = _status_code(status)
    # Not Tally's error shape: probably a proxy or a server that is not Tally; say so.
    text = body[:200].decode("utf-8", "replace").strip()
    message = f"HTTP {status} from {url}: {text or 'no body'} (is this address a Tally coordinator?)"
    return error_for_code(code, message)


def _status_code(status: int) -> StatusCode:
    if status in _STATUS:
        return _STATUS[status]
    if 400 <= status < 500:
        return StatusCode.INVALID_ARGUMENT
    if status >= 500:
        return StatusCode.INTERNAL
    return StatusCode.UNKNOWN


def ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """Verify the server against ``ca_cert`` (else the system's roots); present the client pair if set.

    Raises:
        ValueError: A file is not a usable certificate or key.
    """
    try:
        context = ssl.create_default_context(cafile=tls.ca_cert)
        if tls.client_cert is not None:
            context.load_cert_chain(tls.client_cert, tls.client_key)
    except (OSError, ssl.SSLError) as err:
        files = ", ".join(f"{k}={v!r}" for k, v in vars(tls).items() if v is not None)
        raise ValueError(f"TLS files cannot be used ({files}): {err}") from None
    return context


def tls_hint(err: object, https: bool) -> str:
    """What may cause a connection failure that looks like a TLS mismatch ("" if it does not)."""
    if isinstance(err, ssl.SSLCertVerificationError):
        return (
            " (the coordinator's certificate is not signed by a CA this client trusts: pass ca_cert or set "
            "TALLY_CA_CERT)"
        )
    if not https and isinstance(err, (http.client.RemoteDisconnected, ConnectionResetError)):
        return " (if the coordinator serves TLS, use an https:// address)"
    if https and isinstance(err, (ssl.SSLError, ConnectionResetError)):
        return (
            " (if the coordinator requires client certificates, pass client_cert and client_key or set "
            "TALLY_CLIENT_CERT and TALLY_CLIENT_KEY)"
        )
    return ""


def _parse(parse: Callable[[Any], T], body: Any, what: str) -> T:
    try:
        return parse(body)
    except (KeyError, TypeError, ValueError) as err:
        raise Internal(f"malformed {what} response from the Tally coordinator: {err!r}") from None


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
    ) -> None:
        """Prepare the request; nothing is sent until :meth:`open`.

        Args:
            base_url: ``http[s]://host:port[/prefix]``.
            path: ``/v1/...`` with its query string.
            headers: Request headers (authorization included).
            timeout: Seconds for connecting and receiving the response headers.
            context: TLS settings for ``https``; None: the system's defaults.
        """
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
            raise Unavailable(f"Tally coordinator at {base} is unreachable: {err!r}{hint}") from None
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
        return _parse(convert.checkpoint_from_json, payload, "watch")

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


class HttpTransport:
    """Blocking transport over the HTTP/JSON API using ``urllib.request``."""

    def __init__(self, base_url: str, *, token: str | None = None, tls: TlsFiles | None = None) -> None:
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
            with err:
                raise error_from_response(err.code, err.read(), url) from None
        except urllib.error.URLError as err:
            code = StatusCode.DEADLINE_EXCEEDED if isinstance(err.reason, TimeoutError) else None
            hint = tls_hint(err.reason, self._base.startswith("https:"))
            raise Unavailable(
                f"Tally coordinator at {self._base} is unreachable: {err.reason}{hint}", code
            ) from None
        except TimeoutError:
            raise Unavailable(
                f"Tally coordinator at {self._base} did not answer {method} {path} within {timeout:g}s",
                StatusCode.DEADLINE_EXCEEDED,
            ) from None
        except (http.client.HTTPException, OSError) as err:
            hint = tls_hint(err, self._base.startswith("https:"))
            raise Unavailable(
                f"connection to Tally coordinator at {self._base} failed: {err!r}{hint}"
            ) from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise Internal(f"{method} {url} answered with a body that is not JSON: {raw[:200]!r}") from None

    @staticmethod
    def _query(path: str, query: Mapping[str, str]) -> str:
        return f"{path}?{urllib.parse.urlencode(query)}"

    def _writer_path(self, handle: str, action: str) -> str:
        return f"/v1/writers/{urllib.parse.quote(handle, safe='')}/{action}"

    def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter:
        body = self._request("POST", "/v1/writers", convert.open_writer_body(spec), timeout)
        return _parse(convert.opened_from_json, body, "open writer")

    def keep_alive(self, handle: str, timeout: float) -> float:
        body = self._request("POST", self._writer_path(handle, "keepalive"), None, timeout)
        return _parse(convert.lease_ttl_from_json, body, "keepalive")

    def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts:
        payload = convert.apply_deltas_body(deltas, batch_seq)
        body = self._request("POST", self._writer_path(handle, "deltas"), payload, timeout)
        return _parse(convert.apply_counts_from_json, body, "apply deltas")

    def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]:
        payload = convert.are_completed_body(checkpoint, source_ids)
        body = self._request("POST", "/v1/are-completed", payload, timeout)
        return _parse(convert.completed_from_json, body, "are-completed")

    def flush(self, handle: str, timeout: float) -> int:
        body = self._request("POST", self._writer_path(handle, "flush"), None, timeout)
        return _parse(convert.flushed_from_json, body, "flush")

    def close_writer(self, handle: str, timeout: float) -> CloseResult:
        body = self._request("POST", self._writer_path(handle, "close"), None, timeout)
        return _parse(convert.close_result_from_json, body, "close writer")

    def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus:
        # Checkpoint names are paths like "curation/run-42": keep "/" and quote the rest.
        path = f"/v1/checkpoints/{urllib.parse.quote(name, safe='/')}"
        body = self._request("GET", path, None, timeout)
        return _parse(convert.checkpoint_from_json, body, "checkpoint")

    def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]:
        body = self._request("GET", "/v1/checkpoints", None, timeout)
        return _parse(convert.checkpoints_from_json, body, "checkpoints")

    def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]:
        path = self._query("/v1/writers", convert.list_writers_query(checkpoint, include_closed, limit))
        return _parse(convert.writers_from_json, self._request("GET", path, None, timeout), "writers")

    def list_events(self, checkpoint: str, limit: int, before_id: int | None, timeout: float) -> EventPage:
        path = self._query("/v1/events", convert.list_events_query(checkpoint, limit, before_id))
        return _parse(convert.event_page_from_json, self._request("GET", path, None, timeout), "events")

    def get_progress(self, checkpoint: str, since: float | None, timeout: float) -> list[ProgressSample]:
        path = self._query("/v1/progress", convert.get_progress_query(checkpoint, since))
        return _parse(convert.progress_from_json, self._request("GET", path, None, timeout), "progress")

    def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        path = self._query("/v1/completed", convert.list_completed_query(checkpoint, after, limit))
        return _parse(
            convert.completed_page_from_json, self._request("GET", path, None, timeout), "completed"
        )

    def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult:
        payload = convert.import_completed_body(checkpoint, source_ids, import_id)
        body = self._request("POST", "/v1/import", payload, timeout)
        return _parse(convert.import_result_from_json, body, "import")

    def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult:
        body = self._request("POST", "/v1/reset", convert.reset_body(name, force), timeout)
        return _parse(convert.reset_result_from_json, body, "reset")

    def event_stream(self, checkpoint: str, interval_ms: int, timeout: float) -> EventStream:
        """An unopened Server-Sent Events stream of ``checkpoint``'s status."""
        path = self._query("/v1/watch", convert.watch_query(checkpoint, interval_ms))
        return EventStream(self._base, path, self._headers, timeout, self._context)

    def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> Generator[CheckpointStatus, None, None]:
        stream = self.event_stream(checkpoint, interval_ms, timeout)
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

    async def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter:
        return await asyncio.to_thread(self._sync.open_writer, spec, timeout)

    async def keep_alive(self, handle: str, timeout: float) -> float:
        return await asyncio.to_thread(self._sync.keep_alive, handle, timeout)

    async def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> ApplyCounts:
        return await asyncio.to_thread(self._sync.apply_deltas, handle, deltas, batch_seq, timeout)

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]:
        return await asyncio.to_thread(self._sync.are_completed, checkpoint, source_ids, timeout)

    async def flush(self, handle: str, timeout: float) -> int:
        return await asyncio.to_thread(self._sync.flush, handle, timeout)

    async def close_writer(self, handle: str, timeout: float) -> CloseResult:
        return await asyncio.to_thread(self._sync.close_writer, handle, timeout)

    async def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus:
        return await asyncio.to_thread(self._sync.get_checkpoint, name, timeout)

    async def list_checkpoints(self, timeout: float) -> list[CheckpointStatus]:
        return await asyncio.to_thread(self._sync.list_checkpoints, timeout)

    async def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, timeout: float
    ) -> list[WriterStatus]:
        return await asyncio.to_thread(self._sync.list_writers, checkpoint, include_closed, limit, timeout)

    async def list_events(
        self, checkpoint: str, limit: int, before_id: int | None, timeout: float
    ) -> EventPage:
        return await asyncio.to_thread(self._sync.list_events, checkpoint, limit, before_id, timeout)

    async def get_progress(
        self, checkpoint: str, since: float | None, timeout: float
    ) -> list[ProgressSample]:
        return await asyncio.to_thread(self._sync.get_progress, checkpoint, since, timeout)

    async def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        return await asyncio.to_thread(self._sync.list_completed, checkpoint, after, limit, timeout)

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult:
        return await asyncio.to_thread(
            self._sync.import_completed, checkpoint, source_ids, import_id, timeout
        )

    async def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult:
        return await asyncio.to_thread(self._sync.reset_checkpoint, name, force, timeout)

    async def watch(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> AsyncGenerator[CheckpointStatus, None]:
        stream = self._sync.event_stream(checkpoint, interval_ms, timeout)
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
