"""Wire <-> public type conversion: the only module that touches protobuf fields or JSON shapes.

Responses are read defensively (missing fields take the proto3 zero value) so that a newer
server adding fields, or an HTTP server omitting defaults, does not break the client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tally._types import (
    ApplyCounts,
    CheckpointStatus,
    CloseResult,
    CompletedPage,
    Delta,
    Event,
    EventPage,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ResetResult,
    WriterSpec,
    WriterStatus,
)
from tally.v1 import coordinator_pb2 as pb

# --------------------------------------------------------------------------- protobuf requests


def open_writer_request(spec: WriterSpec) -> Any:
    return pb.OpenWriterRequest(
        checkpoint=spec.checkpoint,
        writer_id=spec.writer_id,
        fingerprint=dict(spec.fingerprint),
        labels=dict(spec.labels),
        host=spec.host,
        pid=spec.pid,
        on_mismatch=_ON_MISMATCH_PB[spec.on_mismatch],
    )


_ON_MISMATCH_PB = {
    "refuse": pb.ON_MISMATCH_REFUSE,
    "reset": pb.ON_MISMATCH_RESET,
    "ignore": pb.ON_MISMATCH_IGNORE,
}


def keep_alive_request(handle: str) -> Any:
    return pb.KeepAliveRequest(handle=handle)


def apply_deltas_request(handle: str, deltas: Sequence[Delta], batch_seq: int) -> Any:
    return pb.ApplyDeltasRequest(
        handle=handle,
        deltas=[pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in deltas],
        batch_seq=batch_seq,
    )


def are_completed_request(checkpoint: str, source_ids: Sequence[str]) -> Any:
    return pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=list(source_ids))


def flush_request(handle: str) -> Any:
    return pb.FlushRequest(handle=handle)


def close_writer_request(handle: str) -> Any:
    return pb.CloseWriterRequest(handle=handle)


def get_checkpoint_request(name: str) -> Any:
    return pb.GetCheckpointRequest(name=name)


def list_checkpoints_request() -> Any:
    return pb.ListCheckpointsRequest()


def list_writers_request(checkpoint: str, include_closed: bool, limit: int) -> Any:
    return pb.ListWritersRequest(checkpoint=checkpoint, include_closed=include_closed, limit=limit)


def list_events_request(checkpoint: str, limit: int, before_id: int | None) -> Any:
    return pb.ListEventsRequest(checkpoint=checkpoint, limit=limit, before_id=before_id or 0)


def get_progress_request(checkpoint: str, since: float | None) -> Any:
    return pb.GetProgressRequest(checkpoint=checkpoint, since=since or 0.0)


def watch_request(checkpoint: str, interval_ms: int) -> Any:
    return pb.WatchCheckpointRequest(checkpoint=checkpoint, interval_ms=interval_ms)


def list_completed_request(checkpoint: str, after: str, limit: int) -> Any:
    return pb.ListCompletedRequest(checkpoint=checkpoint, after=after, limit=limit)


def import_completed_request(checkpoint: str, source_ids: Sequence[str], import_id: str) -> Any:
    return pb.ImportCompletedRequest(checkpoint=checkpoint, source_ids=list(source_ids), import_id=import_id)


def reset_request(name: str, force: bool) -> Any:
    return pb.ResetCheckpointRequest(name=name, force=force)


# --------------------------------------------------------------------------- protobuf responses


def opened_from_pb(msg: Any) -> OpenedWriter:
    return OpenedWriter(
        handle=str(msg.handle),
        writer_id=str(msg.writer_id),
        lease_ttl_s=float(msg.lease_ttl_s),
        completed_count=int(msg.completed_count),
        settle_ms=int(msg.settle_ms),
    )


def lease_ttl_from_pb(msg: Any) -> float:
    return float(msg.lease_ttl_s)


def counts_from_pb(msg: Any) -> ApplyCounts:
    return ApplyCounts(
        applied=int(msg.applied),
        skipped=int(msg.skipped),
        rewritten=int(msg.rewritten),
        anomalies=int(msg.anomalies),
        completed=int(msg.completed),
    )


def apply_counts_from_pb(msg: Any) -> ApplyCounts:
    return counts_from_pb(msg.counts)


def completed_from_pb(msg: Any) -> list[bool]:
    return [bool(b) for b in msg.completed]


def flushed_from_pb(msg: Any) -> int:
    return int(msg.completed)


def close_result_from_pb(msg: Any) -> CloseResult:
    return CloseResult(
        counts=counts_from_pb(msg.counts),
        incomplete_sources=tuple(str(s) for s in msg.incomplete_sources),
        incomplete_count=int(msg.incomplete_count),
    )


def writer_status_from_pb(msg: Any) -> WriterStatus:
    return WriterStatus(
        writer_id=str(msg.writer_id),
        host=str(msg.host),
        pid=int(msg.pid),
        labels={str(k): str(v) for k, v in msg.labels.items()},
        state=str(msg.state),
        pending_sources=int(msg.pending_sources),
        counts=counts_from_pb(msg.counts),
        opened_at=float(msg.opened_at),
        last_seen_at=float(msg.last_seen_at),
        closed_at=float(msg.closed_at),
    )


def checkpoint_from_pb(msg: Any) -> CheckpointStatus:
    return CheckpointStatus(
        name=str(msg.name),
        completed_count=int(msg.completed_count),
        live_writers=int(msg.live_writers),
        pending_sources=int(msg.pending_sources),
        settling_sources=int(msg.settling_sources),
        anomalies=int(msg.anomalies),
        unreadable_files=int(msg.unreadable_files),
        created_at=float(msg.created_at),
        last_activity_at=float(msg.last_activity_at),
        writers=tuple(writer_status_from_pb(w) for w in msg.writers),
        fingerprint={str(k): str(v) for k, v in msg.fingerprint.items()},
    )


def checkpoints_from_pb(msg: Any) -> list[CheckpointStatus]:
    return [checkpoint_from_pb(c) for c in msg.checkpoints]


def writers_from_pb(msg: Any) -> list[WriterStatus]:
    return [writer_status_from_pb(w) for w in msg.writers]


def event_data(text: str) -> dict[str, Any]:
    """Decode an event's ``data_json``; what is not a JSON object is kept rather than lost."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"value": value}


def event_from_pb(msg: Any) -> Event:
    return Event(
        id=int(msg.id),
        checkpoint=str(msg.checkpoint),
        kind=str(msg.kind),
        message=str(msg.message),
        at=float(msg.at),
        writer_id=str(msg.writer_id),
        data=event_data(str(msg.data_json)),
    )


def event_page_from_pb(msg: Any) -> EventPage:
    # The wire says 0 for "no further page"; users get None, which cannot be mistaken for an id.
    return EventPage(
        events=tuple(event_from_pb(e) for e in msg.events), next_before_id=int(msg.next_before_id) or None
    )


def progress_from_pb(msg: Any) -> list[ProgressSample]:
    return [ProgressSample(at=float(p.at), completed_count=int(p.completed_count)) for p in msg.samples]


def completed_page_from_pb(msg: Any) -> CompletedPage:
    return CompletedPage(source_ids=tuple(str(s) for s in msg.source_ids), next_after=str(msg.next_after))


def import_result_from_pb(msg: Any) -> ImportResult:
    return ImportResult(imported=int(msg.imported), completed_count=int(msg.completed_count))


def reset_result_from_pb(msg: Any) -> ResetResult:
    return ResetResult(
        moved_to=str(msg.moved_to), files_moved=int(msg.files_moved), writers_closed=int(msg.writers_closed)
    )


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
    return body


def apply_deltas_body(deltas: Sequence[Delta], batch_seq: int) -> dict[str, Any]:
    return {
        "deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in deltas],
        "batch_seq": batch_seq,
    }


def are_completed_body(checkpoint: str, source_ids: Sequence[str]) -> dict[str, Any]:
    return {"checkpoint": checkpoint, "source_ids": list(source_ids)}


def import_completed_body(checkpoint: str, source_ids: Sequence[str], import_id: str) -> dict[str, Any]:
    return {"checkpoint": checkpoint, "source_ids": list(source_ids), "import_id": import_id}


def reset_body(name: str, force: bool) -> dict[str, Any]:
    return {"name": name, "force": force}


# Query strings of the GET routes (values are strings; the transport URL-encodes them).


def list_writers_query(checkpoint: str, include_closed: bool, limit: int) -> dict[str, str]:
    return {
        "checkpoint": checkpoint,
        "include_closed": "true" if include_closed else "false",
        "limit": str(limit),
    }


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


def watch_query(checkpoint: str, interval_ms: int) -> dict[str, str]:
    return {"checkpoint": checkpoint, "interval_ms": str(interval_ms)}


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


def apply_counts_from_json(body: Any) -> ApplyCounts:
    return counts_from_json(_obj(body).get("counts"))


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
    )


def checkpoints_from_json(body: Any) -> list[CheckpointStatus]:
    return [checkpoint_from_json(c) for c in _obj(body).get("checkpoints") or ()]


def writers_from_json(body: Any) -> list[WriterStatus]:
    return [writer_status_from_json(w) for w in _obj(body).get("writers") or ()]


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


def reset_result_from_json(body: Any) -> ResetResult:
    obj = _obj(body)
    return ResetResult(
        moved_to=str(obj.get("moved_to", "")),
        files_moved=int(obj.get("files_moved", 0)),
        writers_closed=int(obj.get("writers_closed", 0)),
    )
