"""The journal log's format: a header, then records of ops (:mod:`tally_server.store.journal_log`).

A record is ``[u32 length][u32 crc32][payload]``; its payload, ops one after another: a kind byte,
the writer's handle, and for an entry its index, then the bytes (an entry as
:func:`~tally_server.store.journal.encode_entry` encodes it, a writer as ``encode_opened`` does).
Also the file helpers the log is written with: whole writes at an offset, a rewritten log's records,
copying a log's tail, freeing an old log's blocks.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator

from tally_server.domain.ports import ForgetWriter, JournalEntry, JournalOp, OpenJournal
from tally_server.store.journal import encode_entry, encode_opened

MAGIC = b"TALLYJNL"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI")
RECORD = struct.Struct("<II")  # payload length, crc32 of the payload
U32 = struct.Struct("<I")
INDEX = struct.Struct("<Q")
# Kinds of op: open a writer, append an entry (a snapshot drops the entries before it), forget a
# writer; and put an entry as it is (a rewritten log's entries: the live state, nothing to drop).
OPEN, ENTRY, FORGET, PUT = b"O", b"E", b"F", b"P"
SNAPSHOT_KIND = b"S"  # encode_entry's kind byte for a Snapshot

#: A rewritten log holds records of about this size (each writer's ops, split when bigger).
REWRITE_RECORD_BYTES = 1 << 20
#: A replaced log's blocks are freed this many at a time.
RELEASE_STEP_BYTES = 4 << 20


def journal_op(op: JournalOp) -> tuple[bytes, str, int, bytes]:
    """A journal op as its kind, handle, index and bytes."""
    if isinstance(op, OpenJournal):
        return OPEN, op.opened.handle, 0, encode_opened(op.opened)
    if isinstance(op, JournalEntry):
        return ENTRY, op.handle, op.index, encode_entry(op.entry)
    if isinstance(op, ForgetWriter):
        return FORGET, op.handle, 0, b""
    raise TypeError(f"unknown journal op {op!r}")  # pragma: no cover - guarded by the type checker


def encode_op(kind: bytes, handle: str, index: int, raw: bytes) -> bytes:
    """An op as a record's payload holds it."""
    name = handle.encode()
    if kind == FORGET:
        return kind + U32.pack(len(name)) + name
    if kind == OPEN:
        return kind + U32.pack(len(name)) + name + U32.pack(len(raw)) + raw
    return kind + U32.pack(len(name)) + name + INDEX.pack(index) + U32.pack(len(raw)) + raw


def decode_ops(payload: bytes) -> Iterator[tuple[bytes, str, int, bytes]]:
    """The ops of a record's payload (its checksum matched)."""
    view, at = memoryview(payload), 0
    while at < len(view):
        kind = bytes(view[at : at + 1])
        (n,) = U32.unpack_from(view, at + 1)
        handle = bytes(view[at + 5 : at + 5 + n]).decode()
        at += 5 + n
        index = 0
        if kind == FORGET:
            yield kind, handle, 0, b""
            continue
        if kind == ENTRY or kind == PUT:
            (index,) = INDEX.unpack_from(view, at)
            at += INDEX.size
        elif kind != OPEN:
            raise ValueError(f"unknown journal op kind {kind!r} in a record whose checksum matched")
        (n,) = U32.unpack_from(view, at)
        raw = bytes(view[at + 4 : at + 4 + n])
        at += 4 + n
        yield kind, handle, index, raw


def write_all(fd: int, data: bytes, at: int) -> int:
    """Write ``data`` at offset ``at`` (again after a short write); the offset after it."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
    return at


def record(ops: list[bytes]) -> bytes:
    """A record of encoded ops: length, checksum, payload."""
    payload = b"".join(ops)
    return RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def live_records(opened: dict[str, bytes], entries: dict[str, dict[int, bytes]]) -> Iterator[bytes]:
    """A log holding just this live state: the header, then records of about a megabyte."""
    yield HEADER.pack(MAGIC, FORMAT_VERSION)
    ops: list[bytes] = []
    size = 0
    for handle in sorted(opened.keys() | entries.keys()):
        if handle in opened:
            ops.append(encode_op(OPEN, handle, 0, opened[handle]))
            size += len(ops[-1])
        for index, raw in sorted(entries.get(handle, {}).items()):
            ops.append(encode_op(PUT, handle, index, raw))
            size += len(ops[-1])
            if size >= REWRITE_RECORD_BYTES:
                yield record(ops)
                ops, size = [], 0
    if ops:
        yield record(ops)


def copy(source: int, start: int, stop: int, fd: int, at: int) -> tuple[int, int]:
    """Copy bytes ``start:stop`` of ``source`` to ``fd`` at ``at``: the offsets after them, in each."""
    while start < stop:
        data = os.pread(source, min(stop - start, REWRITE_RECORD_BYTES), start)
        if not data:
            raise OSError(f"the writers' journal ended at {start}, before its last record's end {stop}")
        at = write_all(fd, data, at)
        start += len(data)
    return at, start


def chunks(parts: Iterable[bytes]) -> Iterator[bytes]:
    """``parts`` joined into writes of about a rewritten record's size."""
    pending: list[bytes] = []
    size = 0
    for part in parts:
        pending.append(part)
        size += len(part)
        if size >= REWRITE_RECORD_BYTES:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def release(old: int) -> None:
    """Free an old log's blocks a few megabytes at a time (it is unlinked; this is its last fd).

    Freeing them all at once, at the close, is one big filesystem transaction that the commits'
    syncs would wait for (tens of milliseconds for a log of a hundred megabytes on ext4).
    """
    size = os.fstat(old).st_size
    while size > 0:
        size = max(0, size - RELEASE_STEP_BYTES)
        os.ftruncate(old, size)
