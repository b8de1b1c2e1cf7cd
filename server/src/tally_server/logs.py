"""Log handlers for ``tally serve`` (libraries only call logging.getLogger(__name__)), and request ids.

Both transports set :data:`request_id` for the duration of a request (gRPC metadata ``x-request-id``,
HTTP header ``X-Request-ID``, or a new id); :class:`RequestIdFilter` copies it onto every record, so a
line logged deep in the service carries the id of the call that caused it.

Records may carry structured fields as ``extra=`` (:data:`FIELDS`: the checkpoint, writer and event
kind of a service event; method, path, status or code, duration and peer of an access line); the JSON
format writes each as its own key, the text format has them in the message already.

Both transports log one access line per request or call (:func:`access`, logger
``tally_server.access``) at INFO; health checks, ``/metrics``, writers' keep-alives and dashboard
assets only at DEBUG when they succeed, since every writer heartbeats every few seconds.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from tally_server.domain.words import count

NO_REQUEST = "-"
REMIND_EVERY_S = 60.0
DISK_FULL = "the disk is full"  # FailureLog's one cause for every disk-full error

FIELDS = (
    "checkpoint",
    "writer",
    "event",
    "transport",
    "method",
    "path",
    "status",
    "code",
    "duration_ms",
    "peer",
)
"""Record attributes (set with ``extra=``) the JSON format writes as keys of their own."""

access_log = logging.getLogger("tally_server.access")

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tally_request_id", default=NO_REQUEST)
"""The id of the request being handled by the current task ("-" outside requests)."""

# A caller-supplied id is echoed and logged verbatim, so it must be short and log-safe.
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_random_bits = random.Random().getrandbits


def new_request_id() -> str:
    """A new random request id (16 hex digits; it names a call in logs, it guards nothing)."""
    return f"{_random_bits(64):016x}"  # a tenth of uuid4's cost, which reads the OS's entropy


def accept_request_id(incoming: str | None) -> str:
    """The caller's id if it is a sane token, else a new one."""
    if incoming and _VALID_ID.fullmatch(incoming):
        return incoming
    return new_request_id()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Stamp the record with the current request id."""
        record.request_id = request_id.get()
        return True


class _Seconds:
    """``strftime`` of a whole second, remembered until the next one.

    Every call's access line is stamped: most lines of a busy second share its text.
    """

    def __init__(self, fmt: str, convert: Callable[[float | None], time.struct_time]) -> None:
        self._fmt = fmt
        self._convert = convert
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:  # a race between threads only computes the same text twice
            self._text = time.strftime(self._fmt, self._convert(second))
            self._second = second
        return self._text


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, with the local time's text made once per second."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._seconds = _Seconds(self.default_time_format, time.localtime)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        """As :class:`logging.Formatter` does (``2026-12-05 10:00:00,123``)."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return "%s,%03d" % (self._seconds(record.created), record.msecs)  # noqa: UP031 - as logging does


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (time, level, logger, request id, message)."""

    def __init__(self) -> None:
        super().__init__()
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        entry: dict[str, Any] = {
            "ts": self._seconds(record.created) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def access(
    transport: str,
    method: str,
    outcome: int | str,
    duration_s: float,
    peer: str | None,
    *,
    path: str | None = None,
    quiet: bool = False,
    ok: bool = True,
) -> None:
    """One access line: an HTTP request (``outcome`` its status) or a gRPC call (its code name).

    ``quiet`` calls (heartbeats, health checks, scrapes) are logged at DEBUG unless ``ok`` is false.
    Call it while :data:`request_id` is still set, so the line carries the request's id.
    """
    level = logging.DEBUG if quiet and ok else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    ms = int(duration_s * 1_000_000 + 0.5) / 1000  # to the microsecond (round() goes through text)
    fields: dict[str, Any] = {"transport": transport, "method": method, "duration_ms": ms, "peer": peer}
    if isinstance(outcome, int):
        fields.update(path=path, status=outcome)
        access_log.log(level, "%s %s %d %.1f ms from %s", method, path, outcome, ms, peer, extra=fields)
    else:
        fields["code"] = outcome
        access_log.log(level, "%s %s %.1f ms from %s", method, outcome, ms, peer, extra=fields)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def configure(level: str, fmt: str) -> None:
    """Send log records to stderr as text or JSON, at ``level``, with request ids."""
    handler = logging.StreamHandler(sys.stderr)
    # On the handler, not a logger: logger filters do not see records propagated from child loggers.
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Neither format shows where a line was logged from, nor the thread or process: not collecting
    # them is the logging HOWTO's "Optimization" advice, and a third of each record's cost (every
    # call's access line pays it on the event loop).
    logging._srcfile = None  # no caller lookup (it walks the stack with sys._getframe)
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root.setLevel(level.upper())
    # Alembic logs its plugins and each step at INFO; the registry's own lines say what it upgraded.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))


class FailureLog:
    """Logs a failure that repeats (a retry loop, a background task) without flooding the log.

    The first occurrence of each distinct cause is logged with its traceback; while the failure
    goes on, one reminder line per ``remind_every_s`` says how often it happened; the first success
    afterwards is logged once. ``failing`` is the cause while failing, else None.

    A full disk (an error whose ``disk_full`` is true) is one cause whichever file it hit, and is
    logged without a traceback: its message names the disk and what to do, and a full disk under
    hundreds of writers would otherwise log a traceback per writer's file.

    Args:
        logger: where to log.
        what: what failed, e.g. "the lease loop" (the start of each line).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        remind_every_s: float = REMIND_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._remind_every_s = remind_every_s
        self._clock = clock
        self._causes: set[str] = set()
        self._since_reminder = 0
        self._reminded_at = 0.0
        self.failures = 0  # since the last success
        self.failing: str | None = None

    def failed(self, exc: BaseException) -> None:
        """Count a failure; log it once per cause, then a reminder now and then while it lasts."""
        cause = f"{type(exc).__name__}: {exc}"[:500]
        disk_full = getattr(exc, "disk_full", False) is True
        self.failures += 1
        self._since_reminder += 1
        self.failing = cause
        now = self._clock()
        kind = DISK_FULL if disk_full else cause
        if kind not in self._causes:
            self._causes.add(kind)
            self._logger.error("%s failed: %s", self._what, cause, exc_info=None if disk_full else exc)
            self._reminded_at, self._since_reminder = now, 0
        elif now - self._reminded_at >= self._remind_every_s:
            self._logger.error(
                "%s still failing: %s more in %.0f s, last: %s",
                self._what,
                count(self._since_reminder, "time"),
                now - self._reminded_at,
                cause,
            )
            self._reminded_at, self._since_reminder = now, 0

    def succeeded(self) -> None:
        """A step worked: say so once if it was failing, and forget the causes."""
        if self.failing is not None:
            self._logger.warning("%s works again after %s", self._what, count(self.failures, "failure"))
        self._causes.clear()
        self.failures = 0
        self.failing = None
