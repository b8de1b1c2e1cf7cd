"""Writers' journals as an append-only log of the coordinator's own: ``<data_dir>/journal.log``.

A header (magic, format version), then one record per commit: ``[u32 length][u32 crc32][payload]``,
the payload every op of that commit (a kind byte and its fields; entries encoded as
:func:`~tally_server.store.journal.encode_entry` does, the bytes LMDB and PostgreSQL hold). One
``pwrite`` and one ``fdatasync`` per commit: one device flush (LMDB's synced transaction took two,
the data pages, then the meta page).

All or nothing: at open, records apply up to the first one cut short or failing its checksum, and
the file is truncated there (a commit is acknowledged only once synced, so that record never was).
A write that fails is truncated away too, so a later record never follows a partial one; if even
the truncation fails, the journal refuses every commit (saying why and what to do) until one
manages it, and a restart drops the partial record by its checksum.

The live state (who each writer is, its entries' bytes by index) is kept in memory: ``entries()``,
``size_bytes()`` and ``memory_bytes()`` cost nothing (the last is counted against the checkpoints'
memory budget). When the log has grown well past the live state it is rewritten in a thread of its
own, beside the commits: the live state as of an offset of the log to a temporary file, synced;
then the records committed since, copied as they are (most unlocked, the last few under the lock),
synced; the file renamed over the log, the directory synced and the commits' file descriptor
swapped, all under the lock. A crash leaves the old log or the new one, whole, with every
acknowledged commit; a rewrite that fails (a full disk) leaves the old log and is tried again once
the log has grown by ``COMPACT_MIN_BYTES`` more. At open, a mostly dead log is rewritten in place
before anything else, and a data directory with the former LMDB journal (``journal.mdb``) is
migrated the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from tally.integrations.nemo_format import describe_error, fsync_dir
from tally_server.domain.journal import JournaledWriter
from tally_server.domain.ports import CompletionWriteError, JournalOp
from tally_server.store import journal_format as fmt
from tally_server.store.disk import write_error
from tally_server.store.journal import (
    LMDB_JOURNAL_FILENAME,
    LmdbJournal,
    decode_entry,
    decode_opened,
)

log = logging.getLogger(__name__)

LOG_FILENAME = "journal.log"
_TEMP_FILENAME = ".journal.log.tmp"

#: The log is rewritten from the live state once it is past both of these (module-level so that
#: tests can lower them): big enough that rewriting is rare, and mostly dead records.
COMPACT_MIN_BYTES = 64 << 20
COMPACT_RATIO = 4
#: Per-op overhead counted into the live state's size (kind, lengths, index).
_OP_OVERHEAD = 1 + 4 + 8 + 4
#: Memory per entry or writer held, beyond its bytes: the bytes object, its key, its dict slot
#: (tracemalloc: 51 to 58 bytes over ``_live`` per entry, for entries of 50 B to 2 KiB).
_MEMORY_PER_ITEM = 64


class LogJournal:
    """The coordinator's writer journals (one append-only file, owned by this process only).

    Args:
        data_dir: the server's data directory.
    """

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = Path(data_dir)
        self.path = self._data_dir / LOG_FILENAME
        self._lock = threading.Lock()
        self._opened: dict[str, bytes] = {}
        self._entries: dict[str, dict[int, bytes]] = {}
        self._count = 0  # entries held, over every handle
        self._live = 0  # bytes a rewritten log would take (about)
        self._end = 0  # the offset after the last good record: where the next one goes
        self._dirty = False  # a failed write may have left bytes after _end: truncate first
        self._compact_at = 0  # after a failed rewrite, not again before the log reaches this
        self._compactor: threading.Thread | None = None  # a rewrite running in the background
        self._closing = False
        self._dir_unsynced = False  # a rewrite renamed the log in place; its directory not yet synced
        #: Called by a background rewrite at each named point of it (tests pause or crash it there).
        self.rewrite_hook: Callable[[str], None] = _no_hook
        self._fd = -1
        try:
            self._open()
        except OSError as exc:  # at start: one line from tally serve (it reports an OSError so)
            if self._fd >= 0:
                os.close(self._fd)
            raise OSError(str(write_error(self.path, exc, self._data_dir, "the writers' journal"))) from exc

    # --- opening ---------------------------------------------------------------------------------

    def _open(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._data_dir / _TEMP_FILENAME)  # a rewrite a crash interrupted
        lmdb_path = self._data_dir / LMDB_JOURNAL_FILENAME
        if not self.path.exists():
            if lmdb_path.exists():
                self._migrate(lmdb_path)
            else:
                self._rewrite()  # a new, empty log
        else:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._replay()
        if lmdb_path.exists():  # migrated (now, or before a crash that kept it): the log wins
            _remove_lmdb(lmdb_path)
        if self._should_compact():
            self._rewrite()

    def _migrate(self, lmdb_path: Path) -> None:
        old = LmdbJournal(self._data_dir)
        try:
            opened, entries = old.raw()
        finally:
            old.close()
        for handle, raw in opened.items():
            self._put_opened(handle, raw)
        for handle, indexed in entries.items():
            for index, raw in indexed.items():
                self._put_entry(handle, index, raw, snapshot=False)
        self._rewrite()
        log.info(
            "migrated the writers' journal from %s to %s (%d writers, %d entries)",
            lmdb_path,
            self.path,
            len(self._opened),
            self._count,
        )

    def _replay(self) -> None:
        size = os.fstat(self._fd).st_size
        with os.fdopen(os.dup(self._fd), "rb") as reader:
            header = reader.read(fmt.HEADER.size)
            if len(header) < fmt.HEADER.size:
                raise OSError(f"{self.path} is not a Tally journal (shorter than its header)")
            magic, version = fmt.HEADER.unpack(header)
            if magic != fmt.MAGIC:
                raise OSError(f"{self.path} is not a Tally journal (magic {magic!r})")
            if version != fmt.FORMAT_VERSION:
                raise OSError(
                    f"{self.path} is journal format {version}; this Tally reads format {fmt.FORMAT_VERSION} "
                    "(written by a newer Tally? run that version, or move the file away to lose its writers)"
                )
            end = fmt.HEADER.size
            while True:
                prefix = reader.read(fmt.RECORD.size)
                if len(prefix) < fmt.RECORD.size:
                    break
                length, crc = fmt.RECORD.unpack(prefix)
                if length == 0 or end + fmt.RECORD.size + length > size:
                    break  # zeros, or cut short
                payload = reader.read(length)
                if len(payload) < length or zlib.crc32(payload) != crc:
                    break
                for op in fmt.decode_ops(payload):
                    self._apply(op)
                end += fmt.RECORD.size + length
        self._end = end
        if end < size:
            log.warning(
                "the writers' journal %s ends in %d bytes of a write a crash cut short (never "
                "acknowledged); dropping them",
                self.path,
                size - end,
            )
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)

    # --- the live state --------------------------------------------------------------------------

    def _apply(self, op: tuple[bytes, str, int, bytes]) -> None:
        kind, handle, index, raw = op
        if kind == fmt.OPEN:
            self._put_opened(handle, raw)
        elif kind == fmt.ENTRY or kind == fmt.PUT:
            self._put_entry(handle, index, raw, snapshot=kind == fmt.ENTRY)
        else:
            self._forget(handle)

    def _put_opened(self, handle: str, raw: bytes) -> None:
        old = self._opened.get(handle)
        if old is not None:
            self._live -= len(old) + len(handle) + _OP_OVERHEAD
        self._opened[handle] = raw
        self._live += len(raw) + len(handle) + _OP_OVERHEAD

    def _put_entry(self, handle: str, index: int, raw: bytes, *, snapshot: bool = True) -> None:
        indexed = self._entries.setdefault(handle, {})
        if snapshot and raw[:1] == fmt.SNAPSHOT_KIND:  # a snapshot replaces everything before it
            for before in [i for i in indexed if i < index]:
                self._drop(handle, indexed.pop(before))
        old = indexed.get(index)
        if old is not None:
            self._drop(handle, old)
        indexed[index] = raw
        self._count += 1
        self._live += len(raw) + len(handle) + _OP_OVERHEAD

    def _drop(self, handle: str, raw: bytes) -> None:
        self._count -= 1
        self._live -= len(raw) + len(handle) + _OP_OVERHEAD

    def _forget(self, handle: str) -> None:
        opened = self._opened.pop(handle, None)
        if opened is not None:
            self._live -= len(opened) + len(handle) + _OP_OVERHEAD
        for raw in self._entries.pop(handle, {}).values():
            self._drop(handle, raw)

    # --- the protocol ----------------------------------------------------------------------------

    def commit(self, ops: Sequence[JournalOp]) -> None:
        """Append ``ops`` as one record and sync it; durable when this returns, all or nothing."""
        if not ops:
            return
        decoded = [fmt.journal_op(op) for op in ops]
        payload = b"".join(fmt.encode_op(*op) for op in decoded)
        record = fmt.RECORD.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            try:
                if self._fd < 0:
                    raise OSError("the writers' journal is closed")
                if self._dirty:
                    self._truncate()
                if self._dir_unsynced:
                    self._sync_dir()
                self._write(record)
            except _Stuck as exc:
                raise CompletionWriteError(str(exc), path=str(self.path), disk_full=exc.disk_full) from exc
            except OSError as exc:
                raise write_error(self.path, exc, self._data_dir, "the writers' journal") from exc
            for op in decoded:
                self._apply(op)
            if self._should_compact():
                try:
                    self._start_compaction()
                except (OSError, RuntimeError) as exc:  # no fd or thread to spare: the commit stands
                    self._compact_at = self._end + COMPACT_MIN_BYTES
                    log.warning("could not start rewriting the writers' journal %s: %s", self.path, exc)

    def _write(self, record: bytes) -> None:
        try:
            fmt.write_all(self._fd, record, self._end)
            os.fdatasync(self._fd)
        except OSError as exc:
            # Nothing of this record may stay for a later one to follow: cut it off now, or
            # before the next commit if even that fails (no commit is accepted until then).
            self._dirty = True
            try:
                self._truncate()
            except _Stuck as stuck:
                raise stuck from exc
            raise
        self._end += len(record)

    def _truncate(self) -> None:
        try:
            os.ftruncate(self._fd, self._end)
            os.fdatasync(self._fd)
        except OSError as exc:
            error = write_error(self.path, exc, self._data_dir, "the writers' journal")
            raise _Stuck(
                f"the writers' journal {self.path} holds part of a write that failed and cannot cut it "
                f"off ({describe_error(exc)}): it accepts no commit until it can (a record after the "
                "partial one would be lost at the next start), and tries again at each commit. Fix the "
                "disk (free space, check the filesystem and its permissions) or restart tally serve: "
                "the start drops the partial record (its checksum fails), and no acknowledged commit is lost",
                disk_full=error.disk_full,
            ) from exc
        self._dirty = False

    def _should_compact(self) -> bool:
        return self._compactor is None and self._end > max(
            COMPACT_MIN_BYTES, COMPACT_RATIO * self._live, self._compact_at
        )

    def _start_compaction(self) -> None:
        """Rewrite the log in a thread of its own, from the live state as of now (under the lock).

        The commits go on appending to the old log meanwhile; the rewrite copies what they appended
        after it has written the live state, the last of it under the lock, then swaps the logs.
        """
        log.debug(
            "rewriting the writers' journal %s in the background (%d bytes, about %d live)",
            self.path,
            self._end,
            self._live,
        )
        opened = dict(self._opened)
        entries = {handle: dict(indexed) for handle, indexed in self._entries.items()}
        source = os.dup(self._fd)  # the old log, to copy from: still open when the commits' fd is swapped
        self._compactor = threading.Thread(
            target=self._compact,
            args=(opened, entries, self._end, source),
            name="tally-journal-rewrite",
            daemon=True,
        )
        try:
            self._compactor.start()
        except BaseException:
            self._compactor = None
            os.close(source)
            raise

    def _compact(
        self, opened: dict[str, bytes], entries: dict[str, dict[int, bytes]], at: int, source: int
    ) -> None:
        """The rewrite's thread: the live state as of offset ``at`` of the log, then what follows it."""
        temp = self._data_dir / _TEMP_FILENAME
        before, fd, swapped = self._end, -1, False
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            end = 0
            for chunk in fmt.chunks(fmt.live_records(opened, entries)):
                end = fmt.write_all(fd, chunk, end)
                self._checkpoint("writing")
            os.fdatasync(fd)
            self._checkpoint("written")
            # The records committed meanwhile, as they are (a record before the log's end never
            # changes): most of them unlocked, the few committed while copying under the lock.
            end, at = fmt.copy(source, at, self._end, fd, end)
            self._checkpoint("caught up")
            with self._lock:
                if self._closing:
                    raise _Closed
                end, at = fmt.copy(source, at, self._end, fd, end)
                os.fsync(fd)
                self._checkpoint("swapping")
                os.replace(temp, self.path)
                # The new log is the log now: every later commit goes to it, whatever happens next.
                old, self._fd, self._end, self._dirty, fd = self._fd, fd, end, False, -1
                swapped = True
                with contextlib.suppress(OSError):
                    os.close(old)
                self.rewrite_hook("renamed")
                self._sync_dir()
            self.rewrite_hook("rewrote")
            with contextlib.suppress(OSError):  # the close frees the rest
                fmt.release(source)
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            with self._lock:
                self._compact_at = self._end + COMPACT_MIN_BYTES  # not again before grown that much more
            if isinstance(exc, OSError) and swapped:  # only the directory's sync failed
                log.warning(
                    "rewrote the writers' journal %s but could not sync its directory (tried again "
                    "before the next commit): %s",
                    self.path,
                    exc,
                )
            elif isinstance(exc, OSError):  # the old log stays, whole, and takes the commits
                log.warning(
                    "could not rewrite the writers' journal %s (keeping it as it is; will try again "
                    "once it has grown by %d bytes): %s",
                    self.path,
                    COMPACT_MIN_BYTES,
                    exc,
                )
            elif not isinstance(exc, _Closed):
                log.exception("rewriting the writers' journal %s failed", self.path)
            return
        finally:
            os.close(source)
            with self._lock:
                self._compactor = None
        with self._lock:
            self._compact_at = 0
        log.info("rewrote the writers' journal %s: %d bytes down to %d", self.path, before, end)

    def _checkpoint(self, point: str) -> None:
        if self._closing:
            raise _Closed
        self.rewrite_hook(point)

    def _sync_dir(self) -> None:
        """Sync the directory a rewrite renamed into (before the next commit, if it fails now)."""
        self._dir_unsynced = True
        fsync_dir(self._data_dir)
        self._dir_unsynced = False

    def wait_rewritten(self) -> None:
        """Wait for a rewrite of the log running in the background, if any (tests, benchmarks)."""
        with self._lock:
            compactor = self._compactor
        if compactor is not None:
            compactor.join()

    def _rewrite(self) -> None:
        """Write the live state as a fresh log in place of the current one (or of none), at open."""
        temp = self._data_dir / _TEMP_FILENAME
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            end = 0
            for chunk in fmt.chunks(fmt.live_records(self._opened, self._entries)):
                end = fmt.write_all(fd, chunk, end)
            os.fsync(fd)
            os.replace(temp, self.path)
            fsync_dir(self._data_dir)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._end, self._dirty = fd, end, False

    def load(self, owns: Callable[[str], bool] | None = None) -> list[JournaledWriter]:
        """Every journaled writer with its entries in order (from its newest snapshot on).

        ``owns``: only the writers of the checkpoints it accepts.
        """
        found: list[JournaledWriter] = []
        with self._lock:
            for handle in sorted(self._opened, key=str.encode):
                writer = JournaledWriter(decode_opened(self._opened[handle]))
                if owns is not None and not owns(writer.opened.checkpoint):
                    continue
                for index, raw in sorted(self._entries.get(handle, {}).items()):
                    writer.entries.append(decode_entry(raw))
                    writer.last_index = index
                found.append(writer)
        return found

    def size_bytes(self) -> int:
        """Bytes the log takes on disk."""
        return self._end

    def entries(self) -> int:
        """How many entries the journal holds (snapshots keep this bounded per writer)."""
        return self._count

    def memory_bytes(self) -> int:
        """Memory the live state takes (about: its bytes, and Python's objects holding them)."""
        return self._live + _MEMORY_PER_ITEM * (self._count + len(self._opened))

    def close(self) -> None:
        """Close the log file (a rewrite under way stops, leaving the log as it is)."""
        with self._lock:
            self._closing = True
        self.wait_rewritten()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class _Closed(Exception):
    """The journal was closed: a rewrite under way stops."""


class _Stuck(OSError):
    """A failed write's partial record could not be cut off."""

    def __init__(self, message: str, *, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full


def _no_hook(point: str) -> None:
    pass


def _remove_lmdb(path: Path) -> None:
    for stale in (path, path.with_name(path.name + "-lock")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    fsync_dir(path.parent)
