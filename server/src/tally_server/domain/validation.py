"""Input validation: every refusal names what was wrong, the limit involved and what to do."""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tally_server.domain import idmap
from tally_server.domain.ledger import Delta, DeltaBatch, packed_ints, packed_strs
from tally_server.errors import InvalidArgument, ResourceExhausted

# One path segment of a checkpoint name or a writer id: it becomes a directory or a
# file name under the data directory, so only characters that are safe everywhere.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-]*")
_RESERVED_SEGMENTS = {".nemo_curator_metadata", ".trash"}


@dataclass(frozen=True)
class Limits:
    """Refusal limits; each is a server setting."""

    max_deltas_per_call: int = 100_000
    max_ids_per_query: int = 100_000
    # LMDB refuses keys over 511 bytes, and source ids are LMDB keys in the completion files.
    max_id_bytes: int = 511
    max_name_bytes: int = 255
    max_writers_per_checkpoint: int = 10_000
    max_labels: int = 64


# Numbers that reach the registry: SQL integers are 64-bit signed, and PostgreSQL's pid column is
# 32-bit (Linux's pid_max is at most 2^22). Out-of-range values are refused here, at the edge.
MAX_PID = 2**31 - 1
MAX_EVENT_ID = 2**63 - 1

# Error messages echo client input only through describe(), and never exceed these sizes in full: a
# gRPC status travels in trailers, which peers cap at 8-16 KiB together (a longer one reaches the
# client as RESOURCE_EXHAUSTED instead of the real error).
_SHOWN_CHARS = 80
MAX_MESSAGE_BYTES = 2048
MAX_DETAILS_BYTES = 4096


def describe(value: object) -> str:
    """``repr`` of a client-supplied value for an error message, cut to ~80 characters.

    A cut value says how long it was, so ``'aaaa...' (100000 characters)`` still tells the caller
    what was wrong without echoing all of it back.
    """
    if isinstance(value, str):
        if len(value) <= _SHOWN_CHARS:
            return repr(value)
        return f"{value[: _SHOWN_CHARS - 3] + '...'!r} ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"  # str() of a huge int is slow, even refused
    shown = repr(value)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 3] + "..."


def bounded_message(message: str) -> str:
    """``message`` cut to :data:`MAX_MESSAGE_BYTES` of UTF-8: the last guard before a transport sends it."""
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    kept = encoded[: MAX_MESSAGE_BYTES - 64].decode("utf-8", "ignore")
    return f"{kept}... (message cut from {len(encoded)} bytes)"


def bounded_details(details: dict[str, Any]) -> dict[str, Any]:
    """``details`` if their JSON fits :data:`MAX_DETAILS_BYTES`, else a note saying they were left out."""
    size = len(json.dumps(details, default=str))
    if size <= MAX_DETAILS_BYTES:
        return details
    return {"omitted": f"details were {size} bytes of JSON, over {MAX_DETAILS_BYTES}; see the message"}


def checkpoint_name(name: str, limits: Limits) -> str:
    """Return ``name`` if it is a safe checkpoint name (``a/b-1``), else raise InvalidArgument.

    The refusal names the field ``checkpoint`` (``details["field"]``), as most requests call it.
    """
    what, field = "checkpoint name", "checkpoint"
    _utf8(what, name, field)
    if not name:
        raise InvalidArgument(f"{what} is empty; give a name such as 'curation/run-42'", field=field)
    if len(name.encode()) > limits.max_name_bytes:
        raise InvalidArgument(
            f"{what} is {len(name.encode())} bytes, over the limit of {limits.max_name_bytes} "
            "(setting max_name_bytes); use a shorter name",
            field=field,
        )
    if "\x00" in name or "\\" in name or name.startswith("/"):
        raise InvalidArgument(
            f"{what} {describe(name)} is not allowed: no NUL, no backslash, no leading '/'; "
            "use segments of letters, digits, '.', '_' and '-' separated by '/'",
            field=field,
        )
    for segment in name.split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in _RESERVED_SEGMENTS:
            raise InvalidArgument(
                f"{what} {describe(name)} has an invalid segment {describe(segment)}: each segment "
                "between '/' must start with a letter, digit or '_' and hold only letters, digits, "
                "'.', '_' and '-' (no '..', no empty segment)",
                field=field,
            )
    return name


def writer_id(value: str, limits: Limits, field: str = "writer_id") -> str:
    """Return ``value`` if it can name a writer file (``<writer_id>.mdb``), else raise."""
    what = field
    _utf8(what, value, field)
    # The file is "<writer_id>.mdb" and file names are at most 255 bytes.
    longest = min(limits.max_name_bytes, 255 - len(".mdb"))
    if len(value.encode()) > longest:
        raise InvalidArgument(
            f"{what} is {len(value.encode())} bytes, over the limit of {longest} "
            "(it names the file <writer_id>.mdb; setting max_name_bytes); use a shorter id",
            field=field,
        )
    if not _SEGMENT.fullmatch(value):
        raise InvalidArgument(
            f"{what} {describe(value)} is not allowed: it names a file, so it must start with a "
            "letter, digit or '_' and hold only letters, digits, '.', '_' and '-' (e.g. 'host-1234')",
            field=field,
        )
    return value


def _utf8(what: str, value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid UTF-8 ({exc.reason}); send UTF-8 text", field=field
        ) from None


class CheckedDeltas(DeltaBatch):
    """A batch that :func:`deltas` accepted; handing it to :func:`deltas` again costs nothing.

    A transport validates a big batch in a worker thread; the service's own check on the event loop
    then finds nothing left to do. Its columns go on to the ledger and the journal as they are.
    """

    __slots__ = ()


class CheckedIds(tuple[str, ...]):
    """Source ids that :func:`source_ids` accepted (see :class:`CheckedDeltas`)."""

    __slots__ = ()


def too_many_ids(limits: Limits, count: int | None = None) -> ResourceExhausted:
    """The refusal of a query over ``max_ids_per_query`` (``count`` None: counting stopped past it)."""
    shown = f"more than {limits.max_ids_per_query}" if count is None else count
    return ResourceExhausted(
        f"query has {shown} source ids, over the limit of {limits.max_ids_per_query} "
        "(setting max_ids_per_query); split it into smaller queries",
    )


def too_many_deltas(limits: Limits, count: int | None = None) -> ResourceExhausted:
    """The refusal of a batch over ``max_deltas_per_call`` (``count`` None: counting stopped past it)."""
    shown = f"more than {limits.max_deltas_per_call}" if count is None else count
    return ResourceExhausted(
        f"batch has {shown} deltas, over the limit of {limits.max_deltas_per_call} "
        "(setting max_deltas_per_call); send smaller batches",
    )


def source_ids(ids: Sequence[str], limits: Limits) -> CheckedIds:
    """Validate the ids of an AreCompleted query (or an import)."""
    if isinstance(ids, CheckedIds):
        return ids
    if len(ids) > limits.max_ids_per_query:
        raise too_many_ids(limits, len(ids))
    checked = plain_source_ids(ids, limits)
    if checked is not None:
        return checked
    # Something is off (or not ASCII): check each id, to name the first bad one.
    for i, sid in enumerate(ids):
        _id(f"source_ids[{i}]", sid, limits)
    return CheckedIds(ids)


def plain_source_ids(ids: Sequence[str], limits: Limits) -> CheckedIds | None:
    """``source_ids(ids)`` when C-speed checks suffice (ASCII ids within bounds), else None.

    None says nothing is wrong yet: :func:`source_ids` must look at each id (or count them) to
    decide, and to name the first bad one.
    """
    if isinstance(ids, CheckedIds):
        return ids
    if len(ids) > limits.max_ids_per_query:
        return None
    checked = CheckedIds(ids)
    return checked if _plain_ids(checked, limits) else None


MAX_CURSOR_BYTES = 4096


def cursors(items: Sequence[tuple[str, bytes]], limits: Limits) -> dict[str, bytes]:
    """Validate a SaveCursors call; the latest cursor of each source, in order."""
    if len(items) > limits.max_ids_per_query:
        raise too_many_ids(limits, len(items))
    latest: dict[str, bytes] = {}
    for i, (sid, data) in enumerate(items):
        _id(f"cursors[{i}].source_id", sid, limits)
        if len(data) > MAX_CURSOR_BYTES:
            raise InvalidArgument(
                f"cursors[{i}] for source {describe(sid)} holds {len(data)} bytes, over the limit of "
                f"{MAX_CURSOR_BYTES}; keep a cursor small (an offset, a key) and the rest elsewhere",
                field=f"cursors[{i}].data",
            )
        latest.pop(sid, None)
        latest[sid] = bytes(data)
    return latest


def source_id(value: str, limits: Limits) -> str:
    """Validate one source id (named ``source_id``)."""
    _id("source_id", value, limits)
    return value


def deltas(batch: Sequence[Delta], limits: Limits) -> CheckedDeltas:
    """Validate a whole ApplyDeltas batch before any of it is applied."""
    if isinstance(batch, CheckedDeltas):
        return batch
    if len(batch) > limits.max_deltas_per_call:
        raise too_many_deltas(limits, len(batch))
    columns = DeltaBatch.of_rows(batch)
    checked = _plain_columns(columns.task_ids, columns.source_ids, columns.values, limits, int64=False)
    if checked is not None:
        return checked
    # Something is off: find the first bad item, to name it.
    for i, (task_id, source_id, delta) in enumerate(batch):
        _id(f"deltas[{i}].task_id", task_id, limits)
        _id(f"deltas[{i}].source_id", source_id, limits)
        if not -(2**62) < delta < 2**62:
            raise InvalidArgument(
                f"deltas[{i}].delta {describe(delta)} is out of range; deltas are small integers",
                field=f"deltas[{i}].delta",
            )
    return CheckedDeltas(columns.task_ids, columns.source_ids, columns.values)


def delta_columns(
    task_ids: Sequence[str],
    source_ids: Sequence[str],
    values: Sequence[int],
    limits: Limits,
    *,
    int64: bool = False,
) -> CheckedDeltas:
    """Validate a batch sent as three parallel columns (delta i is the i-th of each), as :func:`deltas`.

    ``int64``: the values are known to be 64-bit integers (a protobuf column), so only their range
    is checked.
    """
    count = len(task_ids)
    if count > limits.max_deltas_per_call:
        raise too_many_deltas(limits, count)
    # Read each column once (a protobuf column makes a new str on every read of an item).
    task_ids, source_ids, values = list(task_ids), list(source_ids), list(values)
    if len(source_ids) != count or len(values) != count:
        raise InvalidArgument(
            f"the batch's columns differ in length ({count} task_ids, {len(source_ids)} source_ids, "
            f"{len(values)} deltas); send one task id, one source id and one delta per delta",
            field="columns",
        )
    checked = _plain_columns(task_ids, source_ids, values, limits, int64=int64)
    if checked is not None:
        return checked
    return deltas(list(zip(task_ids, source_ids, values, strict=True)), limits)  # names what is wrong


def _plain_columns(
    task_ids: list[str], source_ids: list[str], values: list[int], limits: Limits, *, int64: bool
) -> CheckedDeltas | None:
    """The batch, if C-speed checks find it surely valid (ASCII ids, small ints); else None.

    The compiled counting core checks it in one pass and packs its columns for the journal as it goes.
    """
    plain = idmap.current().plain_batch
    if plain is not None:
        packed = plain(task_ids, source_ids, values, limits.max_id_bytes)
    else:
        packed = _packed_plain_batch(task_ids, source_ids, values, limits, int64=int64)
    return None if packed is None else CheckedDeltas(task_ids, source_ids, values, packed)


def _packed_plain_batch(
    task_ids: list[str], source_ids: list[str], values: list[int], limits: Limits, *, int64: bool
) -> bytes | None:
    """``plain_batch`` of the compiled core, in Python."""
    tasks = _ascii_column(task_ids, limits)
    if tasks is None:
        return None
    sources = _ascii_column(source_ids, limits)
    if sources is None or not (_small_range(values) if int64 else _small_ints(values)):
        return None
    return tasks + sources + packed_ints(values)


# Up to this many ids, min() and max() over the lengths cost less than a numpy view's set-up.
_SMALL_COLUMN = 32


def _ascii_column(ids: list[str], limits: Limits) -> bytes | None:
    """``ids`` packed as the journal stores them, if each is non-empty ASCII within the size limit.

    None says nothing is wrong yet, only that the careful per-item check must decide.
    """
    try:
        text = "".join(ids)
    except TypeError:  # not a str among them
        return None
    if not text.isascii():
        return None
    lengths = array("I", map(len, ids))  # ASCII: characters are bytes
    if len(ids) > _SMALL_COLUMN:
        sizes = np.frombuffer(lengths, dtype=np.uint32)
        if sizes.min() == 0 or sizes.max() > limits.max_id_bytes:
            return None
    elif ids and (min(lengths) == 0 or max(lengths) > limits.max_id_bytes):
        return None
    return packed_strs(lengths, text.encode("ascii"))


def _plain_ids(ids: Sequence[str], limits: Limits) -> bool:
    """Whether every id is surely valid: non-empty ASCII within the size limit (C-speed checks).

    False says nothing is wrong yet, only that the careful per-item check must decide.
    """
    try:
        return (
            "".join(ids).isascii()  # one C pass over the characters, not a call per id
            and "" not in ids
            and max(map(len, ids), default=0) <= limits.max_id_bytes
        )
    except TypeError:  # not a str among them
        return False


def _small_ints(values: Sequence[int]) -> bool:
    """Whether every delta is surely valid: an int (not a bool) well inside the range."""
    return set(map(type, values)) <= {int} and _small_range(values)  # type() at C speed


def _small_range(values: Sequence[int]) -> bool:
    """Whether every one of these integers is well inside the range of a delta."""
    return -(2**62) < min(values, default=0) and max(values, default=0) < 2**62


def pid(value: int) -> int:
    """Return ``value`` if it can be a process id (0: unknown), else raise InvalidArgument."""
    if not 0 <= value <= MAX_PID:
        raise InvalidArgument(
            f"pid {describe(value)} is out of range; send the writer's process id (0 to {MAX_PID}), "
            "or 0 if there is none",
            field="pid",
        )
    return value


MAX_BATCH_SEQ = 2**64 - 1  # uint64 on the wire
MAX_SESSION_TOKEN = 128


def batch_seq(value: int) -> int:
    """Return ``value`` if it can number a client's batch (0: not numbered), else raise."""
    if not 0 <= value <= MAX_BATCH_SEQ:
        raise InvalidArgument(
            f"batch_seq {describe(value)} is out of range; number batches 1, 2, 3, … (at most "
            f"{MAX_BATCH_SEQ}), or send 0 if they are not numbered",
            field="batch_seq",
        )
    return value


def session_token(value: str) -> str:
    """Return ``value`` if it can be a client's session token (empty: none), else raise."""
    return _client_token("session_token", value, "a random hex string")


def attempt_id(value: str) -> str:
    """Return ``value`` if it can name a failed attempt (empty: unnamed), else raise."""
    return _client_token("attempt_id", value, "a random hex string, new for each attempt")


def _client_token(field: str, value: str, example: str) -> str:
    """A name a client makes up: at most ``MAX_SESSION_TOKEN`` printable ASCII characters, or empty."""
    if len(value) > MAX_SESSION_TOKEN or not value.isascii() or not value.isprintable():
        raise InvalidArgument(
            f"{field} {describe(value)} is not allowed: send at most {MAX_SESSION_TOKEN} printable "
            f"ASCII characters (e.g. {example}), or none",
            field=field,
        )
    return value


def before_id(value: int) -> int:
    """Return ``value`` if it can be an event id to page before (0: from the newest), else raise."""
    if not 0 <= value <= MAX_EVENT_ID:
        raise InvalidArgument(
            f"before_id {describe(value)} is out of range; pass 0 for the newest events or a "
            f"next_before_id from an earlier page (at most {MAX_EVENT_ID})",
            field="before_id",
        )
    return value


# Pages of checkpoints and of writers (ListCheckpoints, ListWriters): items are whole statuses, so
# the most per page is a fixed 10,000 rather than max_ids_per_query.
DEFAULT_STATUS_PAGE = 1000
MAX_STATUS_PAGE = 10_000


def status_page_limit(limit: int, what: str) -> int:
    """``limit`` of a page of checkpoints or writers (``what``), 0 meaning the default 1,000; else raise."""
    limit = limit or DEFAULT_STATUS_PAGE
    if not 0 < limit <= MAX_STATUS_PAGE:
        raise InvalidArgument(
            f"limit {describe(limit)} is out of range; ask for 1 to {MAX_STATUS_PAGE:,} {what} per page "
            f"(0: {DEFAULT_STATUS_PAGE:,})",
            field="limit",
        )
    return limit


def checkpoint_after(after: str, limits: Limits) -> str:
    """``after`` of a page of checkpoints: empty, or a checkpoint name (the previous page's next_after)."""
    if after:
        try:
            checkpoint_name(after, limits)
        except InvalidArgument as exc:
            raise InvalidArgument(
                f"after is not a checkpoint name ({exc.message}); pass the previous page's next_after, "
                "or '' for the first page",
                field="after",
            ) from None
    return after


def _id(what: str, value: str, limits: Limits, field: str | None = None) -> None:
    """Refuse an empty, non-UTF-8 or oversized id; ``field`` (default: ``what``) names it in the refusal."""
    field = field or what
    if not value:
        raise InvalidArgument(f"{what} is empty; every id must be a non-empty string", field=field)
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid UTF-8 ({exc.reason}); send UTF-8 text", field=field
        ) from None
    if size > limits.max_id_bytes:
        raise InvalidArgument(
            f"{what} is {size} bytes, over the limit of {limits.max_id_bytes} "
            "(setting max_id_bytes); use shorter ids (NeMo Curator's are hashes)",
            field=field,
        )


def labels(values: dict[str, str], limits: Limits, field: str = "labels") -> None:
    """Refuse too many labels, or keys and values that are not bounded UTF-8 ids.

    ``field`` names the map in the refusal (a fingerprint is checked like labels).
    """
    if len(values) > limits.max_labels:
        raise InvalidArgument(
            f"{len(values)} labels, over the limit of {limits.max_labels} (setting max_labels)",
            field=field,
        )
    for key, value in values.items():
        _id(f"label key {describe(key)}", key, limits, field)
        _utf8(f"label {describe(key)}", value, field)
        if len(value.encode()) > limits.max_id_bytes:
            raise InvalidArgument(
                f"label {describe(key)} is over the limit of {limits.max_id_bytes} bytes "
                "(setting max_id_bytes)",
                field=field,
            )


def host(value: str, limits: Limits) -> None:
    """Refuse a host name that is not UTF-8 or is longer than ``max_name_bytes``."""
    _utf8("host", value, "host")
    if len(value.encode()) > limits.max_name_bytes:
        raise InvalidArgument(
            f"host is {len(value.encode())} bytes, over the limit of {limits.max_name_bytes} "
            "(setting max_name_bytes)",
            field="host",
        )
