"""HTTP/JSON transports over the coordinator's REST API (``/v1``), stdlib only."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tally import _convert as convert
from tally._types import ApplyCounts, CheckpointStatus, CloseResult, Delta, OpenedWriter, WriterSpec
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


def _parse(parse: Callable[[Any], T], body: Any, what: str) -> T:
    try:
        return parse(body)
    except (KeyError, TypeError, ValueError) as err:
        raise Internal(f"malformed {what} response from the Tally coordinator: {err!r}") from None


class HttpTransport:
    """Blocking transport over the HTTP/JSON API using ``urllib.request``."""

    def __init__(self, base_url: str, *, token: str | None = None) -> None:
        """Create the transport.

        Args:
            base_url: ``http[s]://host:port[/prefix]``; ``/v1/...`` is appended.
            token: Bearer token sent as the ``Authorization`` header.
        """
        self._base = base_url.rstrip("/")
        self._headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._opener = urllib.request.build_opener()

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
            raise Unavailable(
                f"Tally coordinator at {self._base} is unreachable: {err.reason}", code
            ) from None
        except TimeoutError:
            raise Unavailable(
                f"Tally coordinator at {self._base} did not answer {method} {path} within {timeout:g}s",
                StatusCode.DEADLINE_EXCEEDED,
            ) from None
        except (http.client.HTTPException, OSError) as err:
            raise Unavailable(f"connection to Tally coordinator at {self._base} failed: {err!r}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise Internal(f"{method} {url} answered with a body that is not JSON: {raw[:200]!r}") from None

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

    async def close(self) -> None:
        self._sync.close()
