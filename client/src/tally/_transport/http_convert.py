"""HTTP/JSON wire <-> public types: the only module that knows the ``/v1`` JSON shapes.

:data:`ROUTES` maps each call description to its HTTP method and path (query string included),
its JSON body and the reader of the answer. Readers take the parsed JSON body and read it
defensively (a missing member takes the proto3 zero value) so that a newer server adding members,
or one omitting defaults, still reads; a body of the wrong shape raises KeyError, TypeError or
ValueError, which the transport reports as ``Internal``.
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from tally import _calls as calls
from tally._calls import Call
from tally._types import (
    ApplyCounts,
    CheckpointPage,
    CheckpointStatus,
    Claim,
    CloseResult,
    CompletedPage,
    Delta,
    Event,
    EventPage,
    FailedAttempt,
    FailurePage,
    FailureReport,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    Replica,
    Replicas,
    ResetResult,
    Severity,
    SourceFailures,
    WriterPage,
    WriterSpec,
    WriterStatus,
)

C = TypeVar("C", bound=Call[Any])
T = TypeVar("T")


@dataclass(frozen=True)
class Route(Generic[C, T]):
    """How one call description travels over HTTP: ``path`` includes the query string."""

    method: str
    path: Callable[[C], str]
    body: Callable[[C], dict[str, Any] | bytes | None]  # bytes: the JSON already encoded
    read: Callable[[Any], T]


def route(call: Call[T]) -> Route[Call[T], T]:
    """The route of ``call``'s operation."""
    return cast("Route[Call[T], T]", ROUTES[type(call)])


def _query(path: str, query: Mapping[str, str]) -> str:
    return f"{path}?{urllib.parse.urlencode(query)}" if query else path


def writer_path(handle: str, action: str) -> str:
    return f"/v1/writers/{urllib.parse.quote(handle, safe='')}/{action}"


def checkpoint_path(name: str) -> str:
    # Checkpoint names are paths like "curation/run-42": keep "/" and quote the rest.
    return f"/v1/checkpoints/{urllib.parse.quote(name, safe='/')}"


# --------------------------------------------------------------------------- JSON requests


def open_writer_body(spec: WriterSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"checkpoint": spec.checkpoint, "host": spec.host, "pid": spec.pid}
    # Optional members are omitted rather than sent empty, matching the API's "?" fields.
    if spec.writer_id:
        body["writer_id"] = spec.writer_id
    if spec.fingerprint:
        body["fingerprint"] = dict(spec.fingerprint)
    if spec.labels:
        body["labels"] = dict(spec.labels)
    if spec.on_mismatch != "refuse":
        body["on_mismatch"] = spec.on_mismatch
    if spec.session_token:
        body["session_token"] = spec.session_token
    return body


def apply_deltas_body(
    deltas: Sequence[Delta], batch_seq: int, columns: bool = False, ordered: bool = False
) -> dict[str, Any] | bytes:
    """The body of an ApplyDeltas: a JSON object, or its encoding when it is written directly."""
    head: dict[str, Any] = {"batch_seq": batch_seq, "ordered": True} if ordered else {"batch_seq": batch_seq}
    if columns and deltas:
        # Three parallel columns: half the bytes of one object per delta, and cheaper on both sides.
        written = columns_json(deltas, head)
        if written is not None:
            return written
        task_ids, source_ids, values = zip(*deltas, strict=True)
        return {"columns": {"task_ids": task_ids, "source_ids": source_ids, "deltas": values}, **head}
    return {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in deltas], **head}


_TASK_ID, _SOURCE_ID, _DELTA = (operator.itemgetter(i) for i in range(3))
# What a JSON string cannot hold as it is (RFC 8259), but for '"' (counted apart): control
# characters and the backslash.
_ESCAPED = bytes(range(0x20)) + b"\\"
# The text of the deltas a batch holds nearly always (the counting rules' +1 and -1, fan-outs).
_SMALL_INTS = {i: str(i).encode() for i in range(-256, 257)}


def columns_json(deltas: Sequence[Delta], head: Mapping[str, Any]) -> bytes | None:
    """``{"columns": {...}, **head}`` of a non-empty batch as JSON, written directly; None when an
    id needs escaping.

    Less than half of what zipping the batch into columns and ``json.dumps`` take for a batch of
    1,000 plain ids (0.24 against 0.53 ms), which the client spends per batch on the sender's
    thread. The deltas are ints, not bools (the SDK validated them).
    """
    tasks, sources = _plain_json_strs(deltas, _TASK_ID), _plain_json_strs(deltas, _SOURCE_ID)
    if tasks is None or sources is None:
        return None
    try:
        numbers = b",".join(map(_SMALL_INTS.__getitem__, map(_DELTA, deltas)))
    except KeyError:
        numbers = ",".join(map(str, map(_DELTA, deltas))).encode()
    extra = "".join(f',"{key}":{json.dumps(value)}' for key, value in head.items()).encode()
    return b"".join(
        (b'{"columns":{"task_ids":["', tasks, b'"],"source_ids":["', sources, b'"],"deltas":[')
        + (numbers, b"]}", extra, b"}")
    )


def _plain_json_strs(deltas: Sequence[Delta], column: Callable[[Delta], str]) -> bytes | None:
    """The ids of ``column`` joined by ``","``: the inside of their JSON array when none of them
    needs escaping (ASCII without a control character, quote or backslash), else None."""
    text = '","'.join(map(column, deltas))
    if not text.isascii():
        return None
    raw = text.encode("ascii")
    # Every '"' must be a separator's: an id holding one would end its string early.
    if raw.count(b'"') != 2 * (len(deltas) - 1) or len(raw.translate(None, _ESCAPED)) != len(raw):
        return None
    return raw


def are_completed_body(checkpoint: str, source_ids: Sequence[str]) -> dict[str, Any]:
    return {"checkpoint": checkpoint, "source_ids": list(source_ids)}


def import_completed_body(checkpoint: str, source_ids: Sequence[str], import_id: str) -> dict[str, Any]:
    return {"checkpoint": checkpoint, "source_ids": list(source_ids), "import_id": import_id}


def save_cursors_body(cursors: Sequence[tuple[str, bytes]]) -> dict[str, Any]:
    return {
        "cursors": [
            {"source_id": source_id, "data": base64.b64encode(data).decode("ascii")}
            for source_id, data in cursors
        ]
    }


def reset_body(name: str, force: bool) -> dict[str, Any]:
    return {"name": name, "force": force}


# Query strings of the GET routes (values are strings; _query URL-encodes them).


def list_writers_query(checkpoint: str, include_closed: bool, limit: int, after: str = "") -> dict[str, str]:
    query = {
        "checkpoint": checkpoint,
        "include_closed": "true" if include_closed else "false",
        "limit": str(limit),
    }
    if after:
        query["after"] = after
    return query


def list_checkpoints_query(after: str, limit: int, writers: bool = True) -> dict[str, str]:
    query = {"limit": str(limit)} if limit else {}
    if after:
        query["after"] = after
    if not writers:
        query["writers"] = "false"
    return query


def list_events_query(checkpoint: str, limit: int, before_id: int | None) -> dict[str, str]:
    query = {"checkpoint": checkpoint, "limit": str(limit)}
    if before_id:
        query["before_id"] = str(before_id)
    return query


def get_progress_query(checkpoint: str, since: float | None) -> dict[str, str]:
    query = {"checkpoint": checkpoint}
    if since:
        query["since"] = repr(float(since))
    return query


def watch_path(call: calls.WatchCheckpoint) -> str:
    return _query("/v1/watch", {"checkpoint": call.checkpoint, "interval_ms": str(call.interval_ms)})


def list_failures_path(call: calls.ListFailures) -> str:
    # Repeated ``source_id`` parameters: a list of pairs, not a mapping.
    query: list[tuple[str, str]] = [("checkpoint", call.checkpoint)]
    query += [("source_id", sid) for sid in call.source_ids]
    if call.failed_only:
        query.append(("failed_only", "true"))
    if call.after:
        query.append(("after", call.after))
    if call.limit:
        query.append(("limit", str(call.limit)))
    return f"/v1/failures?{urllib.parse.urlencode(query)}"


def list_completed_query(checkpoint: str, after: str, limit: int) -> dict[str, str]:
    query = {"checkpoint": checkpoint, "limit": str(limit)}
    if after:
        query["after"] = after
    return query


# --------------------------------------------------------------------------- JSON responses
# These raise KeyError / TypeError / ValueError on a malformed body; the HTTP transport turns
# that into ``Internal``.


def _obj(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _str_map(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in _obj(value).items()}


def opened_from_json(body: Any) -> OpenedWriter:
    obj = _obj(body)
    return OpenedWriter(
        handle=str(obj["handle"]),
        writer_id=str(obj.get("writer_id", "")),
        lease_ttl_s=float(obj.get("lease_ttl_s", 0.0)),
        completed_count=int(obj.get("completed_count", 0)),
        settle_ms=int(obj.get("settle_ms", 0)),
        delta_columns=obj.get("accepts_delta_columns") is True,
        max_batches_in_flight=max(1, int(obj.get("max_batches_in_flight", 1))),
    )


def lease_ttl_from_json(body: Any) -> float:
    return float(_obj(body).get("lease_ttl_s", 0.0))


def counts_from_json(body: Any) -> ApplyCounts:
    obj = _obj(body)
    return ApplyCounts(
        applied=int(obj.get("applied", 0)),
        skipped=int(obj.get("skipped", 0)),
        rewritten=int(obj.get("rewritten", 0)),
        anomalies=int(obj.get("anomalies", 0)),
        completed=int(obj.get("completed", 0)),
    )


def batch_answer_from_json(body: Any) -> calls.BatchAnswer:
    obj = _obj(body)
    refused = obj.get("refused", 0)
    return calls.BatchAnswer(
        counts_from_json(obj.get("counts")),
        obj.get("settled") is True,
        refused if isinstance(refused, int) else 0,
    )


def completed_from_json(body: Any) -> list[bool]:
    values = _obj(body)["completed"]
    if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
        raise TypeError("'completed' must be a list of booleans")
    return list(values)


def flushed_from_json(body: Any) -> int:
    return int(_obj(body).get("completed", 0))


def close_result_from_json(body: Any) -> CloseResult:
    obj = _obj(body)
    return CloseResult(
        counts=counts_from_json(obj.get("counts")),
        incomplete_sources=tuple(str(s) for s in obj.get("incomplete_sources") or ()),
        incomplete_count=int(obj.get("incomplete_count", 0)),
    )


def writer_status_from_json(body: Any) -> WriterStatus:
    obj = _obj(body)
    return WriterStatus(
        writer_id=str(obj.get("writer_id", "")),
        host=str(obj.get("host", "")),
        pid=int(obj.get("pid", 0)),
        labels=_str_map(obj.get("labels")),
        state=str(obj.get("state", "")),
        pending_sources=int(obj.get("pending_sources", 0)),
        counts=counts_from_json(obj.get("counts")),
        opened_at=float(obj.get("opened_at", 0.0)),
        last_seen_at=float(obj.get("last_seen_at", 0.0)),
        closed_at=float(obj.get("closed_at") or 0.0),
    )


def checkpoint_from_json(body: Any) -> CheckpointStatus:
    obj = _obj(body)
    return CheckpointStatus(
        name=str(obj["name"]),
        completed_count=int(obj.get("completed_count", 0)),
        live_writers=int(obj.get("live_writers", 0)),
        pending_sources=int(obj.get("pending_sources", 0)),
        settling_sources=int(obj.get("settling_sources", 0)),
        anomalies=int(obj.get("anomalies", 0)),
        unreadable_files=int(obj.get("unreadable_files", 0)),
        created_at=float(obj.get("created_at", 0.0)),
        last_activity_at=float(obj.get("last_activity_at", 0.0)),
        writers=tuple(writer_status_from_json(w) for w in obj.get("writers") or ()),
        fingerprint=_str_map(obj.get("fingerprint")),
        owner=str(obj.get("owner") or ""),
        failed_sources=int(obj.get("failed_sources", 0)),
        max_attempts=int(obj.get("max_attempts", 0)),
        total=int(obj.get("total") or 0),
        remaining=int(obj.get("remaining", -1)) if obj.get("total") else -1,
        claimed_sources=int(obj.get("claimed_sources", 0)),
    )


def replicas_from_json(body: Any) -> Replicas:
    obj = _obj(body)
    return Replicas(
        replicas=tuple(
            Replica(
                name=str(r["name"]),
                grpc_address=str(r.get("grpc_address", "")),
                http_address=str(r.get("http_address", "")),
                owner=bool(r.get("owner", False)),
                started_at=float(r.get("started_at", 0.0)),
                silent_s=float(r.get("silent_s", 0.0)),
                shards=tuple(int(s) for s in r.get("shards") or ()),
            )
            for r in (_obj(x) for x in obj.get("replicas") or ())
        ),
        epoch=int(obj.get("epoch", 0)),
        answered_by=str(obj.get("answered_by") or ""),
    )


def checkpoints_from_json(body: Any) -> CheckpointPage:
    obj = _obj(body)
    return CheckpointPage(
        tuple(checkpoint_from_json(c) for c in obj.get("checkpoints") or ()), str(obj.get("next_after") or "")
    )


def writers_from_json(body: Any) -> WriterPage:
    obj = _obj(body)
    return WriterPage(
        tuple(writer_status_from_json(w) for w in obj.get("writers") or ()), str(obj.get("next_after") or "")
    )


def event_from_json(body: Any) -> Event:
    obj = _obj(body)
    return Event(
        id=int(obj["id"]),
        checkpoint=str(obj.get("checkpoint", "")),
        kind=str(obj.get("kind", "")),
        message=str(obj.get("message", "")),
        at=float(obj.get("at", 0.0)),
        writer_id=str(obj.get("writer_id") or ""),
        data=dict(_obj(obj.get("data"))),
        severity=Severity.from_wire(str(obj.get("severity") or "")),
    )


def event_page_from_json(body: Any) -> EventPage:
    obj = _obj(body)
    return EventPage(
        events=tuple(event_from_json(e) for e in obj.get("events") or ()),
        next_before_id=int(obj.get("next_before_id") or 0) or None,
    )


def progress_from_json(body: Any) -> list[ProgressSample]:
    samples = []
    for item in _obj(body).get("samples") or ():
        sample = _obj(item)
        samples.append(ProgressSample(at=float(sample["at"]), completed_count=int(sample["completed_count"])))
    return samples


def completed_page_from_json(body: Any) -> CompletedPage:
    obj = _obj(body)
    ids = obj.get("source_ids") or []
    if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids):
        raise TypeError("'source_ids' must be a list of strings")
    return CompletedPage(source_ids=tuple(ids), next_after=str(obj.get("next_after") or ""))


def import_result_from_json(body: Any) -> ImportResult:
    obj = _obj(body)
    return ImportResult(imported=int(obj["imported"]), completed_count=int(obj["completed_count"]))


def cursors_saved_from_json(body: Any) -> calls.CursorsSaved:
    obj = _obj(body)
    return calls.CursorsSaved(saved=int(obj.get("saved", 0)), completed=int(obj.get("completed", 0)))


def cursor_from_json(body: Any) -> calls.SavedCursor | None:
    obj = _obj(body)
    if obj.get("found") is not True:
        return None
    text = obj.get("data") or ""
    if not isinstance(text, str):
        raise TypeError("'data' must be a base64 string")
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error as err:
        raise ValueError(f"'data' is not base64: {err}") from None
    return calls.SavedCursor(
        data=data, saved_at=float(obj.get("saved_at", 0.0)), writer_id=str(obj.get("writer_id") or "")
    )


def claims_from_json(body: Any) -> list[Claim]:
    claims = _obj(body).get("claims")
    if not isinstance(claims, list):
        raise TypeError("'claims' must be a list")
    return [
        Claim(
            source_id=str(c["source_id"]),
            state=str(c["state"]),
            token=int(c.get("token", 0)),
            holder=str(c.get("holder", "")),
            until=float(c.get("until", 0.0)),
        )
        for c in map(_obj, claims)
    ]


def failure_report_from_json(body: Any) -> FailureReport:
    obj = _obj(body)
    return FailureReport(
        attempts=int(obj.get("attempts", 0)),
        failed=bool(obj.get("failed", False)),
        max_attempts=int(obj.get("max_attempts", 0)),
    )


def _failed_attempt_from_json(value: Any) -> FailedAttempt:
    obj = _obj(value)
    return FailedAttempt(
        reason=str(obj.get("reason") or ""),
        at=float(obj.get("at", 0.0)),
        writer_id=str(obj.get("writer_id") or ""),
    )


def failure_page_from_json(body: Any) -> FailurePage:
    obj = _obj(body)
    sources = []
    for value in obj.get("sources") or ():
        src = _obj(value)
        sources.append(
            SourceFailures(
                source_id=str(src["source_id"]),
                attempts=int(src.get("attempts", 0)),
                failed=bool(src.get("failed", False)),
                recent=tuple(_failed_attempt_from_json(a) for a in src.get("recent") or ()),
            )
        )
    return FailurePage(
        sources=tuple(sources),
        next_after=str(obj.get("next_after") or ""),
        max_attempts=int(obj.get("max_attempts", 0)),
    )


def reset_result_from_json(body: Any) -> ResetResult:
    obj = _obj(body)
    return ResetResult(
        moved_to=str(obj.get("moved_to", "")),
        files_moved=int(obj.get("files_moved", 0)),
        writers_closed=int(obj.get("writers_closed", 0)),
    )


# --------------------------------------------------------------------------- the table

ROUTES: dict[type[Call[Any]], Route[Any, Any]] = {}


def _add(
    call: type[C],
    method: str,
    path: Callable[[C], str],
    read: Callable[[Any], T],
    body: Callable[[C], dict[str, Any] | bytes | None] | None = None,
) -> None:
    ROUTES[call] = Route(method, path, body or (lambda c: None), read)


_add(calls.OpenWriter, "POST", lambda c: "/v1/writers", opened_from_json, lambda c: open_writer_body(c.spec))
_add(calls.KeepAlive, "POST", lambda c: writer_path(c.handle, "keepalive"), lease_ttl_from_json)
_add(
    calls.ApplyDeltas,
    "POST",
    lambda c: writer_path(c.handle, "deltas"),
    batch_answer_from_json,
    lambda c: apply_deltas_body(c.deltas, c.batch_seq, c.columns, c.ordered),
)
_add(
    calls.AreCompleted,
    "POST",
    lambda c: "/v1/are-completed",
    completed_from_json,
    lambda c: are_completed_body(c.checkpoint, c.source_ids),
)
_add(calls.Flush, "POST", lambda c: writer_path(c.handle, "flush"), flushed_from_json)
_add(calls.CloseWriter, "POST", lambda c: writer_path(c.handle, "close"), close_result_from_json)
_add(calls.GetCheckpoint, "GET", lambda c: checkpoint_path(c.name), checkpoint_from_json)
_add(
    calls.ListCheckpoints,
    "GET",
    lambda c: _query("/v1/checkpoints", list_checkpoints_query(c.after, c.limit, c.writers)),
    checkpoints_from_json,
)
_add(calls.ListReplicas, "GET", lambda c: "/v1/replicas", replicas_from_json)
_add(
    calls.ListWriters,
    "GET",
    lambda c: _query("/v1/writers", list_writers_query(c.checkpoint, c.include_closed, c.limit, c.after)),
    writers_from_json,
)
_add(
    calls.ListEvents,
    "GET",
    lambda c: _query("/v1/events", list_events_query(c.checkpoint, c.limit, c.before_id)),
    event_page_from_json,
)
_add(
    calls.GetProgress,
    "GET",
    lambda c: _query("/v1/progress", get_progress_query(c.checkpoint, c.since)),
    progress_from_json,
)
_add(
    calls.ListCompleted,
    "GET",
    lambda c: _query("/v1/completed", list_completed_query(c.checkpoint, c.after, c.limit)),
    completed_page_from_json,
)
_add(
    calls.ImportCompleted,
    "POST",
    lambda c: "/v1/import",
    import_result_from_json,
    lambda c: import_completed_body(c.checkpoint, c.source_ids, c.import_id),
)
_add(
    calls.ResetCheckpoint,
    "POST",
    lambda c: "/v1/reset",
    reset_result_from_json,
    lambda c: reset_body(c.name, c.force),
)
_add(
    calls.SaveCursors,
    "POST",
    lambda c: writer_path(c.handle, "cursors"),
    cursors_saved_from_json,
    lambda c: save_cursors_body(c.cursors),
)
_add(
    calls.GetCursor,
    "GET",
    lambda c: _query("/v1/cursors", {"checkpoint": c.checkpoint, "source_id": c.source_id}),
    cursor_from_json,
)
_add(
    calls.ReportFailure,
    "POST",
    lambda c: writer_path(c.handle, "failures"),
    failure_report_from_json,
    lambda c: {"source_id": c.source_id, "reason": c.reason, "attempt_id": c.attempt_id},
)
_add(
    calls.Acquire,
    "POST",
    lambda c: writer_path(c.handle, "acquire"),
    claims_from_json,
    lambda c: {"source_ids": list(c.source_ids)},
)
_add(
    calls.TokenIsCurrent,
    "GET",
    lambda c: _query(
        "/v1/claims/current", {"checkpoint": c.checkpoint, "source_id": c.source_id, "token": str(c.token)}
    ),
    lambda body: _obj(body).get("current") is True,
)
_add(
    calls.ListFailures,
    "GET",
    list_failures_path,
    failure_page_from_json,
)
_add(
    calls.RetryFailed,
    "POST",
    lambda c: "/v1/failures/retry",
    lambda body: int(_obj(body).get("cleared", 0)),
    lambda c: {"checkpoint": c.checkpoint, "source_ids": list(c.source_ids)},
)
_add(
    calls.SetFailureBudget,
    "POST",
    lambda c: "/v1/failures/budget",
    lambda body: calls.FailureBudget(
        max_attempts=int(_obj(body).get("max_attempts", 0)),
        failed_sources=int(_obj(body).get("failed_sources", 0)),
    ),
    lambda c: {"checkpoint": c.checkpoint, "max_attempts": c.max_attempts},
)
_add(
    calls.DeclareSources,
    "POST",
    lambda c: "/v1/declare",
    lambda body: calls.Declared(
        total=int(_obj(body).get("total") or 0), remaining=int(_obj(body).get("remaining", -1))
    ),
    lambda c: {"checkpoint": c.checkpoint, "source_ids": list(c.source_ids), "count": c.count},
)
_add(
    calls.ListRemaining,
    "GET",
    lambda c: _query("/v1/remaining", list_completed_query(c.checkpoint, c.after, c.limit)),
    completed_page_from_json,
)
