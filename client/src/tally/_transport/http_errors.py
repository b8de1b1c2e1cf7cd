"""HTTP failures -> SDK errors: the one status table, the error body, and hints for TLS mismatches."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from tally._transport.base import TlsFiles
from tally._transport.contact import FirstContact
from tally.errors import Internal, StatusCode, TallyError, Unavailable, error_for_code

T = TypeVar("T")

# The one HTTP status -> SDK status table, used when the body carries no error code. A Tally
# coordinator always sends one: it answers 409 both for ALREADY_EXISTS and FAILED_PRECONDITION, so
# the status alone cannot tell them apart. 412 and 422 come from other servers (earlier Tally
# coordinators answered FAILED_PRECONDITION with 412).
_STATUS: dict[int, StatusCode] = {
    400: StatusCode.INVALID_ARGUMENT,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.NOT_FOUND,
    405: StatusCode.UNIMPLEMENTED,
    409: StatusCode.ALREADY_EXISTS,
    412: StatusCode.FAILED_PRECONDITION,
    422: StatusCode.INVALID_ARGUMENT,  # FastAPI's default request-validation status
    429: StatusCode.RESOURCE_EXHAUSTED,
    499: StatusCode.CANCELLED,
    500: StatusCode.INTERNAL,
    501: StatusCode.UNIMPLEMENTED,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.DEADLINE_EXCEEDED,
}
# Codes of the error body that are HTTP's own, not a tally.v1 status: a route the coordinator does
# not serve with that method (an SDK newer than the server), as gRPC's UNIMPLEMENTED.
_HTTP_CODES: dict[str, StatusCode] = {"METHOD_NOT_ALLOWED": StatusCode.UNIMPLEMENTED}


def error_from_response(status: int, body: bytes, url: str) -> TallyError:
    """Translate an HTTP error response: by the body's ``error.code`` if present, else by status."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        named = str(error.get("code"))
        try:
            code = _HTTP_CODES.get(named) or StatusCode(named)
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


def unreachable(
    err: httpx.HTTPError, base: str, what: str, timeout: float, contact: FirstContact
) -> Unavailable:
    """The error for a request that got no HTTP answer (``what``: e.g. ``POST /v1/flush``).

    A timeout is DEADLINE_EXCEEDED; a refused connection to a coordinator that never answered is
    :class:`~tally._transport.contact.NeverReached` (see ``contact``).
    """
    if isinstance(err, httpx.TimeoutException):
        return Unavailable(
            f"Tally coordinator at {base} did not answer {what} within {timeout:g}s",
            StatusCode.DEADLINE_EXCEEDED,
        )
    causes = chain(err)
    hint = tls_hint(causes, base.startswith("https:"))
    failed = Unavailable(f"Tally coordinator at {base} is unreachable: {str(err) or repr(err)}{hint}")
    if isinstance(err, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError):
        # The request went out on an open connection that broke (a server disconnected without an
        # answer, a reset): something listened there.
        return contact.broke(failed)
    refused = any(isinstance(e, ConnectionRefusedError) for e in causes)
    return contact.failed(failed, refused=refused)


def chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors below it: httpx wraps httpcore's, which wraps the OSError or SSLError."""
    causes = [err]
    while len(causes) < 10:
        # httpcore re-raises its own error "from None": the OSError is then only its context.
        below = causes[-1].__cause__ or causes[-1].__context__
        if below is None:
            break
        causes.append(below)
    return causes


def tls_hint(causes: list[BaseException], https: bool) -> str:
    """What may cause a connection failure that looks like a TLS mismatch ("" if it does not)."""

    def any_of(*kinds: type[BaseException]) -> bool:
        return any(isinstance(e, kinds) for e in causes)

    if any_of(ssl.SSLCertVerificationError):
        return (
            " (the coordinator's certificate is not signed by a CA this client trusts: pass ca_cert or set "
            "TALLY_CA_CERT)"
        )
    # A TLS server reading a plain request closes the connection without an HTTP answer.
    if not https and any_of(httpx.RemoteProtocolError, ConnectionResetError):
        return " (if the coordinator serves TLS, use an https:// address)"
    if https and any_of(ssl.SSLError, ConnectionResetError, httpx.RemoteProtocolError):
        return (
            " (if the coordinator requires client certificates, pass client_cert and client_key or set "
            "TALLY_CLIENT_CERT and TALLY_CLIENT_KEY)"
        )
    return ""


def parse(parse: Callable[[Any], T], body: Any, what: str) -> T:
    try:
        return parse(body)
    except (KeyError, TypeError, ValueError) as err:
        raise Internal(f"the Tally coordinator's answer to {what} is malformed: {err!r}") from None
