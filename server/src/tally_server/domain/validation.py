"""Input validation: every refusal names what was wrong, the limit involved and what to do."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

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


def _describe(value: str) -> str:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return repr(shown)


def checkpoint_name(name: str, limits: Limits) -> str:
    """Return ``name`` if it is a safe checkpoint name (``a/b-1``), else raise InvalidArgument."""
    what = "checkpoint name"
    _utf8(what, name)
    if not name:
        raise InvalidArgument(f"{what} is empty; give a name such as 'curation/run-42'")
    if len(name.encode()) > limits.max_name_bytes:
        raise InvalidArgument(
            f"{what} is {len(name.encode())} bytes, over the limit of {limits.max_name_bytes} "
            "(setting max_name_bytes); use a shorter name",
        )
    if "\x00" in name or "\\" in name or name.startswith("/"):
        raise InvalidArgument(
            f"{what} {_describe(name)} is not allowed: no NUL, no backslash, no leading '/'; "
            "use segments of letters, digits, '.', '_' and '-' separated by '/'",
        )
    for segment in name.split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in _RESERVED_SEGMENTS:
            raise InvalidArgument(
                f"{what} {_describe(name)} has an invalid segment {_describe(segment)}: each segment "
                "between '/' must start with a letter, digit or '_' and hold only letters, digits, "
                "'.', '_' and '-' (no '..', no empty segment)",
            )
    return name


def writer_id(value: str, limits: Limits) -> str:
    """Return ``value`` if it can name a writer file (``<writer_id>.mdb``), else raise."""
    what = "writer_id"
    _utf8(what, value)
    # The file is "<writer_id>.mdb" and file names are at most 255 bytes.
    longest = min(limits.max_name_bytes, 255 - len(".mdb"))
    if len(value.encode()) > longest:
        raise InvalidArgument(
            f"{what} is {len(value.encode())} bytes, over the limit of {longest} "
            "(it names the file <writer_id>.mdb; setting max_name_bytes); use a shorter id",
        )
    if not _SEGMENT.fullmatch(value):
        raise InvalidArgument(
            f"{what} {_describe(value)} is not allowed: it names a file, so it must start with a "
            "letter, digit or '_' and hold only letters, digits, '.', '_' and '-' (e.g. 'host-1234')",
        )
    return value


def _utf8(what: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid UTF-8 ({exc.reason}); send UTF-8 text") from None


def source_ids(ids: Sequence[str], limits: Limits) -> None:
    """Validate the ids of an AreCompleted query."""
    if len(ids) > limits.max_ids_per_query:
        raise ResourceExhausted(
            f"query has {len(ids)} source ids, over the limit of {limits.max_ids_per_query} "
            "(setting max_ids_per_query); split it into smaller queries",
        )
    for i, sid in enumerate(ids):
        _id(f"source_ids[{i}]", sid, limits)


def deltas(batch: Sequence[tuple[str, str, int]], limits: Limits) -> None:
    """Validate a whole ApplyDeltas batch before any of it is applied."""
    if len(batch) > limits.max_deltas_per_call:
        raise ResourceExhausted(
            f"batch has {len(batch)} deltas, over the limit of {limits.max_deltas_per_call} "
            "(setting max_deltas_per_call); send smaller batches",
        )
    for i, (task_id, source_id, delta) in enumerate(batch):
        _id(f"deltas[{i}].task_id", task_id, limits)
        _id(f"deltas[{i}].source_id", source_id, limits)
        if not -(2**62) < delta < 2**62:
            raise InvalidArgument(f"deltas[{i}].delta {delta} is out of range; deltas are small integers")


def _id(what: str, value: str, limits: Limits) -> None:
    if not value:
        raise InvalidArgument(f"{what} is empty; every id must be a non-empty string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid UTF-8 ({exc.reason}); send UTF-8 text") from None
    if size > limits.max_id_bytes:
        raise InvalidArgument(
            f"{what} is {size} bytes, over the limit of {limits.max_id_bytes} "
            "(setting max_id_bytes); use shorter ids (NeMo Curator's are hashes)",
        )


def labels(values: dict[str, str], limits: Limits) -> None:
    if len(values) > limits.max_labels:
        raise InvalidArgument(
            f"{len(values)} labels, over the limit of {limits.max_labels} (setting max_labels)",
        )
    for key, value in values.items():
        _id(f"label key {key!r}", key, limits)
        _utf8(f"label {key!r}", value)
        if len(value.encode()) > limits.max_id_bytes:
            raise InvalidArgument(
                f"label {key!r} is over the limit of {limits.max_id_bytes} bytes (setting max_id_bytes)",
            )


# Linux pids stay below 2**22; the registry stores them in a 32-bit column.
MAX_PID = 2**31 - 1
# Ids that page through the registry (event ids) are 64-bit database keys.
MAX_PAGE_ID = 2**63 - 1


def pid(value: int) -> None:
    if not 0 <= value <= MAX_PID:
        raise InvalidArgument(
            f"pid {value} is out of range; send the writer's process id (1 to {MAX_PID}) or 0 if unknown",
        )


def page_id(what: str, value: int) -> None:
    if not 0 <= value <= MAX_PAGE_ID:
        raise InvalidArgument(
            f"{what} {value} is out of range; pass 0 for the first page, then the id the previous page "
            "returned",
        )


def host(value: str, limits: Limits) -> None:
    _utf8("host", value)
    if len(value.encode()) > limits.max_name_bytes:
        raise InvalidArgument(
            f"host is {len(value.encode())} bytes, over the limit of {limits.max_name_bytes} "
            "(setting max_name_bytes)",
        )
