"""The journal's entry encoding, and the former LMDB journal (``<data_dir>/journal.mdb``).

The coordinator journals in an append-only log now (:mod:`tally_server.store.journal_log`, one
device flush per commit where LMDB's synced transaction took two); :class:`LmdbJournal` stays to
read a data directory written before, which the log migrates at open.

The LMDB journal: not NeMo Curator's format and not in a checkpoint's folder (nothing NeMo reads):
two databases, ``writers`` (handle → who the writer is, JSON) and ``entries`` (handle + index → one entry, a
compact binary record). One synced write transaction per commit, so a group of entries of many
writers costs one ``fsync``. A torn write cannot leave half a record behind: LMDB's copy-on-write
B-tree publishes a transaction whole or not at all, and its meta page is synced (metasync).
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from tally_server.domain.journal import (
    Applied,
    Completing,
    Entry,
    JournaledWriter,
    Opened,
    Persisted,
    Reverted,
    Snapshot,
)
from tally_server.domain.ledger import ApplyCounts, DeltaBatch, LedgerState, packed_ints, packed_strs
from tally_server.domain.ports import ForgetWriter, JournalEntry, JournalOp, OpenJournal
from tally_server.store.disk import write_error

LMDB_JOURNAL_FILENAME = "journal.mdb"
_MAP_SIZE = 1 << 30
_MAX_MAP_GROWTHS = 10
_WRITERS = b"writers"
_ENTRIES = b"entries"
_INDEX = struct.Struct(">Q")
_COUNTS = struct.Struct("<5q")
_SEQ = struct.Struct("<Q")
_COUNT = struct.Struct("<I")


class LmdbJournal:
    """The coordinator's writer journals (one LMDB environment, owned by this process only).

    Args:
        data_dir: the server's data directory.
    """

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = Path(data_dir)
        self.path = self._data_dir / LMDB_JOURNAL_FILENAME
        self._env = lmdb.open(
            str(self.path),
            subdir=False,
            max_dbs=2,
            map_size=_MAP_SIZE,
            lock=False,  # one process (the data-dir lock keeps a second coordinator off)
            sync=True,
            metasync=True,
            readahead=False,
        )
        self._writers = self._env.open_db(_WRITERS)
        self._entries = self._env.open_db(_ENTRIES)

    def commit(self, ops: Sequence[JournalOp]) -> None:
        """Apply ``ops`` in order in one synced transaction; durable when this returns."""
        if not ops:
            return
        try:
            for _ in range(_MAX_MAP_GROWTHS + 1):
                try:
                    with self._env.begin(write=True) as txn:
                        for op in ops:
                            self._apply(txn, op)
                    return
                except lmdb.MapFullError:
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
            raise lmdb.MapFullError(f"journal map still full after {_MAX_MAP_GROWTHS} doublings")
        except (lmdb.Error, OSError) as exc:
            raise write_error(self.path, exc, self._data_dir, "the writers' journal") from exc

    def _apply(self, txn: Any, op: JournalOp) -> None:
        if isinstance(op, OpenJournal):
            txn.put(op.opened.handle.encode(), encode_opened(op.opened), db=self._writers)
        elif isinstance(op, JournalEntry):
            key = _key(op.handle, op.index)
            if isinstance(op.entry, Snapshot):
                # A snapshot replaces everything before it.
                self._delete_entries(txn, op.handle, before=op.index)
            txn.put(key, encode_entry(op.entry), db=self._entries)
        elif isinstance(op, ForgetWriter):
            txn.delete(op.handle.encode(), db=self._writers)
            self._delete_entries(txn, op.handle, before=None)
        else:  # pragma: no cover - guarded by the type checker
            raise TypeError(f"unknown journal op {op!r}")

    def _delete_entries(self, txn: Any, handle: str, *, before: int | None) -> None:
        prefix = handle.encode() + b":"
        with txn.cursor(db=self._entries) as cursor:
            if not cursor.set_range(prefix):
                return
            while cursor.key().startswith(prefix):
                if before is not None and _INDEX.unpack(cursor.key()[len(prefix) :])[0] >= before:
                    return
                if not cursor.delete():
                    return

    def load(self, owns: Callable[[str], bool] | None = None) -> list[JournaledWriter]:
        """Every journaled writer with its entries in order (from its newest snapshot on).

        ``owns``: only the writers of the checkpoints it accepts (their entries are not read).
        """
        found: list[JournaledWriter] = []
        with self._env.begin() as txn:
            for handle, raw in txn.cursor(db=self._writers):
                writer = JournaledWriter(decode_opened(raw))
                if owns is not None and not owns(writer.opened.checkpoint):
                    continue
                prefix = handle + b":"
                with txn.cursor(db=self._entries) as cursor:
                    if cursor.set_range(prefix):
                        for key, value in cursor:
                            if not key.startswith(prefix):
                                break
                            writer.entries.append(decode_entry(value))
                            writer.last_index = _INDEX.unpack(key[len(prefix) :])[0]
                found.append(writer)
        return found

    def raw(self) -> tuple[dict[str, bytes], dict[str, dict[int, bytes]]]:
        """Everything stored, as stored: who each writer is, and each handle's entries by index."""
        opened: dict[str, bytes] = {}
        entries: dict[str, dict[int, bytes]] = {}
        with self._env.begin() as txn:
            for name, raw in txn.cursor(db=self._writers):
                opened[bytes(name).decode()] = bytes(raw)
            for key, raw in txn.cursor(db=self._entries):  # handle, ":", big-endian index
                (index,) = _INDEX.unpack(key[-_INDEX.size :])
                entries.setdefault(bytes(key[: -1 - _INDEX.size]).decode(), {})[index] = bytes(raw)
        return opened, entries

    def size_bytes(self) -> int:
        """Bytes in use by the journal (pages of the current tree)."""
        info, stat = self._env.info(), self._env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])

    def entries(self) -> int:
        """How many entries the journal holds (snapshots keep this bounded per writer)."""
        with self._env.begin() as txn:
            return int(txn.stat(self._entries)["entries"])

    def memory_bytes(self) -> int:
        """Always 0: the entries stay in the LMDB file (its pages are the kernel's cache)."""
        return 0

    def close(self) -> None:
        """Close the journal's LMDB file."""
        self._env.close()


def _key(handle: str, index: int) -> bytes:
    return handle.encode() + b":" + _INDEX.pack(index)


def encode_opened(opened: Opened) -> bytes:
    """Who a writer is, as stored: JSON with sorted keys."""
    return json.dumps(opened.__dict__, sort_keys=True).encode()


def decode_opened(raw: bytes) -> Opened:
    """Read back what ``encode_opened`` wrote."""
    return Opened(**json.loads(raw))


# --- entries: one kind byte, then compact fields ------------------------------------------------


def encode_entry(entry: Entry) -> bytes:
    """A journal entry as stored: a one-byte kind, then its fields."""
    out = bytearray()
    if isinstance(entry, Applied):
        out += b"A" + _SEQ.pack(entry.seq)
        columns = DeltaBatch.of_rows(entry.deltas)  # a checked batch is columns already
        if columns.packed is not None:  # packed by validation already (as below)
            out += columns.packed
        else:
            _pack_strs(out, columns.task_ids)
            _pack_strs(out, columns.source_ids)
            _pack_ints(out, columns.values)
        _pack_strs(out, entry.hits)
    elif isinstance(entry, Completing):
        out += b"C"
        _pack_strs(out, entry.sources)
    elif isinstance(entry, Persisted):
        out += b"P"
        _pack_strs(out, entry.sources)
    elif isinstance(entry, Reverted):
        out += b"R"
        _pack_strs(out, entry.sources)
    else:
        state = entry.state
        out += b"S" + _SEQ.pack(entry.seq) + _pack_counts(entry.counts) + _pack_counts(state.totals)
        _pack_strs(out, list(state.pending))
        _pack_ints(out, list(state.pending.values()))
        _pack_strs(out, list(state.applied))
        _pack_ints(out, list(state.applied.values()))
        _pack_strs(out, sorted(state.own_completed))
        _pack_strs(out, sorted(state.uncompleted))
        _pack_strs(out, state.settling)
        _pack_strs(out, entry.unconfirmed)
    return bytes(out)


def decode_entry(raw: bytes) -> Entry:
    """Read back an entry written by ``encode_entry``."""
    kind, view = raw[:1], memoryview(raw)
    if kind == b"A":
        (seq,) = _SEQ.unpack_from(view, 1)
        reader = _Reader(view, 1 + _SEQ.size)
        tasks, sources, deltas, hits = reader.strs(), reader.strs(), reader.ints(), reader.strs()
        return Applied(seq, list(zip(tasks, sources, deltas, strict=True)), hits)
    if kind == b"C":
        return Completing(_Reader(view, 1).strs())
    if kind == b"P":
        return Persisted(_Reader(view, 1).strs())
    if kind == b"R":
        return Reverted(_Reader(view, 1).strs())
    if kind == b"S":
        (seq,) = _SEQ.unpack_from(view, 1)
        counts = ApplyCounts(*_COUNTS.unpack_from(view, 1 + _SEQ.size))
        totals = ApplyCounts(*_COUNTS.unpack_from(view, 1 + _SEQ.size + _COUNTS.size))
        reader = _Reader(view, 1 + _SEQ.size + 2 * _COUNTS.size)
        pending = dict(zip(reader.strs(), reader.ints(), strict=True))
        applied = dict(zip(reader.strs(), reader.ints(), strict=True))
        own, uncompleted, settling = set(reader.strs()), set(reader.strs()), reader.strs()
        state = LedgerState(pending, applied, own, uncompleted, settling, totals)
        return Snapshot(state, seq, counts, reader.strs())
    raise ValueError(f"unknown journal entry kind {bytes(kind)!r}")


def _pack_counts(counts: ApplyCounts) -> bytes:
    return _COUNTS.pack(counts.applied, counts.skipped, counts.rewritten, counts.anomalies, counts.completed)


def _pack_strs(out: bytearray, values: Iterable[str]) -> None:
    values = values if isinstance(values, list | tuple) else list(values)
    joined = "".join(values)
    if joined.isascii():  # one character, one byte: no need to encode each string on its own
        lengths = array("I", map(len, values))
        blob = joined.encode()
    else:
        encoded = [v.encode() for v in values]
        lengths = array("I", map(len, encoded))
        blob = b"".join(encoded)
    out += packed_strs(lengths, blob)


def _pack_ints(out: bytearray, values: Sequence[int]) -> None:
    out += packed_ints(values)


class _Reader:
    def __init__(self, view: memoryview, offset: int) -> None:
        self._view, self._at = view, offset

    def _count(self) -> int:
        (n,) = struct.unpack_from("<I", self._view, self._at)
        self._at += 4
        return int(n)

    def strs(self) -> list[str]:
        n = self._count()
        lengths = array("I")
        lengths.frombytes(self._view[self._at : self._at + 4 * n])
        self._at += 4 * n
        blob = bytes(self._view[self._at : self._at + sum(lengths)])
        self._at += len(blob)
        return list(_split(blob, lengths))

    def ints(self) -> list[int]:
        n = self._count()
        numbers = array("q")
        numbers.frombytes(self._view[self._at : self._at + 8 * n])
        self._at += 8 * n
        return numbers.tolist()


def _split(blob: bytes, lengths: Iterable[int]) -> Iterator[str]:
    at = 0
    for length in lengths:
        yield blob[at : at + length].decode()
        at += length


class NoJournal:
    """No journal (``journal = false``): writers open at a restart are lost, as before journals."""

    def commit(self, ops: Sequence[JournalOp]) -> None:
        """Keep nothing."""

    def load(self, owns: Callable[[str], bool] | None = None) -> list[JournaledWriter]:
        """Nothing is journaled, so nothing comes back (whatever ``owns`` accepts)."""
        return []

    def size_bytes(self) -> int:
        """Always 0: nothing on disk."""
        return 0

    def entries(self) -> int:
        """Always 0: nothing is kept."""
        return 0

    def memory_bytes(self) -> int:
        """Always 0: nothing is kept."""
        return 0

    def close(self) -> None:
        """Nothing to close."""
