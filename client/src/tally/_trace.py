"""Recording a writer's calls to a JSONL trace file (``client.writer(..., trace=PATH)``, ``TALLY_TRACE``).

One JSON object per line, in the format of ``tests/fixtures/nemo_curator_1.4.0_trace_fanout_filter.jsonl``
(see ``tally.replay`` for every field) plus ``at`` (seconds since the epoch) and ``writer`` (the id the
writer asked for). ``tally replay TRACE`` runs a trace through the counting rules.

Each row is written with one ``write`` of a whole line to a file opened for appending, so rows of
several writers (threads or processes) sharing one file never mix inside a line; ``{writer_id}`` in
the path gives each writer a file of its own instead. Recording never raises: a trace that cannot be
written is switched off with one warning, and the pipeline goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger("tally._writer")

TRACE_ENV = "TALLY_TRACE"
WRITER_PLACEHOLDER = "{writer_id}"


def trace_path(path: str | os.PathLike[str], writer_id: str) -> str:
    """``path`` with ``{writer_id}`` replaced by ``writer_id`` (path separators made ``_``)."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"trace must be a non-empty path, got {path!r}")
    safe = writer_id.replace(os.sep, "_").replace("/", "_")
    return text.replace(WRITER_PLACEHOLDER, safe)


class TraceRecorder:
    """Appends rows to one trace file; safe to call from any thread.

    Args:
        path: The file (created if missing, appended to otherwise).
        writer: The writer id every row carries.

    Raises:
        OSError: The file cannot be opened for appending.
    """

    def __init__(self, path: str, writer: str) -> None:
        self.path = path
        self._writer = json.dumps(writer)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()  # seq order is file order
        self._seq = 0
        # A writer dropped without close() must not leak the descriptor; runs at most once.
        self._release = weakref.finalize(self, _close_fd, self._fd)

    def record(self, method: str, **fields: Any) -> None:
        """Append one row: ``seq``, ``at``, ``writer``, ``method`` and ``fields``. Never raises."""
        try:
            body = json.dumps(fields, separators=(", ", ": "), default=str)[1:-1] if fields else ""
        except (TypeError, ValueError) as exc:  # a caller's object JSON cannot hold
            body = '"unrecordable": ' + json.dumps(repr(exc))
        tail = f", {body}}}\n" if body else "}\n"
        with self._lock:
            if self._fd is None:
                return
            self._seq += 1
            line = (
                f'{{"seq": {self._seq}, "at": {time.time():.6f}, "writer": {self._writer}, '
                f'"method": {json.dumps(method)}{tail}'
            ).encode()
            try:
                # One write of the whole line: O_APPEND keeps concurrent writers' lines whole.
                written = os.write(self._fd, line)
                while written < len(line):  # short writes happen only on full disks and the like
                    written += os.write(self._fd, line[written:])
            except OSError as exc:
                logger.warning(
                    "tally trace %s could not be written (%s); tracing is off from here", self.path, exc
                )
                self._close_locked()

    def close(self) -> None:
        """Stop recording (later rows are ignored) and close the file."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._fd = None
        self._release()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def open_recorder(path: str | os.PathLike[str] | None, writer_id: str) -> TraceRecorder | None:
    """A recorder for ``path`` (``TALLY_TRACE`` when None; no trace when that is unset too, or
    when ``path`` is ``""``).

    Raises:
        InvalidArgument: The path is empty, or its file cannot be opened for appending.
    """
    from tally.errors import InvalidArgument

    if path is None:
        path = os.environ.get(TRACE_ENV, "").strip() or None
        if path is None:
            return None
        source = f"{TRACE_ENV}={path!r}"
    elif isinstance(path, str | os.PathLike) and not os.fspath(path):
        return None
    else:
        source = f"trace={path!r}"
    try:
        return TraceRecorder(trace_path(path, writer_id), writer_id)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidArgument(
            f"{source}: cannot open the trace file for appending ({exc}); give a writable file path"
        ) from None
