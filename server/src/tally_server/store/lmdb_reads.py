"""Reads of completion files that the compact index needs.

Hashing every key of a file (a load), looking ids up (confirming a hash hit), and listing keys in
order (export pages).

Every transaction on a file runs under that file's lock (see ``HandleCache``) and goes through the
file's write handle when this process holds one open. Otherwise a read-only handle is kept open
(least recently used first out), reopened when the file at that path changed (a quarantined file
replaced by a fresh one) or grew past its map.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import numpy.typing as npt

from tally.integrations import lmdb_pages, nemo_format
from tally.integrations.nemo_format import READ_ERRORS, describe_error
from tally_server.domain import idmap
from tally_server.domain.compact import U64, Hasher
from tally_server.store.file_handles import HandleCache, OpenFile

logger = logging.getLogger(__name__)

# Keys hashed per step of a load: a step is also where another thread may take the GIL.
_LOAD_CHUNK = 1 << 15
# Keys hashed per array pass when read from the pages: the hash's state stays in the CPU's cache.
_HASH_CHUNK = 1 << 15


def _pack(data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> U64:
    """``lmdb_pages.pack_words``, by the compiled core when it runs, else in numpy.

    The compiled core copies each key into its row: a third of numpy's time, beside the event loop
    (it lets go of the GIL).
    """
    rows = idmap.current().pack_rows
    if rows is not None:
        out = np.empty((len(offsets), int(lengths.max(initial=0)) // 8 + 1), dtype=np.uint64)
        if rows(data, np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(lengths, np.int64), out):
            return out
    return lmdb_pages.pack_words(data, offsets, lengths)


def _hash_pages(path: Path, txn: Any, db: Any, env: Any, hasher: Hasher) -> U64 | None:
    """The hashes of the file's keys read from its pages; None: walk it with a cursor.

    The pages are checked even when the hash cannot be computed from them (a custom hash).

    Raises:
        DamagedFileError: see ``nemo_format.check_pages``.
    """
    parts: list[U64] = []
    usable = hasher.spans_supported

    def hash_batch(keys: lmdb_pages.Keys) -> None:
        nonlocal usable
        for i in range(0, len(keys.lengths), _HASH_CHUNK):
            if not usable:
                return
            part = hasher.of_words(keys.words[i : i + _HASH_CHUNK], keys.lengths[i : i + _HASH_CHUNK])
            if part is None:
                usable = False
                return
            parts.append(part)

    if not nemo_format.check_pages(path, txn, db, env, hash_batch, _pack) or not usable:
        return None
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)


class FileReads:
    """Read access to completion files beside the store's write handles."""

    def __init__(self, writes: HandleCache, max_open_files: int) -> None:
        self._writes = writes
        self._readers = HandleCache(max_open_files, locks=writes)
        self._inodes: dict[Path, tuple[int, int]] = {}
        # Files read whole (from their checked pages, or by a cursor walk of every key), by inode:
        # a read handle opens on them (lookups, ``keys_after``) without checking their pages again.
        self._vouched: dict[Path, tuple[int, int]] = {}

    def close(self) -> None:
        """Close every read handle."""
        self._readers.close()

    def drop_folder(self, folder: Path) -> None:
        """Close every read handle of a file in ``folder`` (before the folder is moved)."""
        self._readers.drop_folder(folder)

    def forget(self, path: Path) -> None:
        """Close the read handle of ``path``; the caller holds the file's lock.

        LMDB refuses to open a file a second time in one process, so this comes before any other
        handle on it opens.
        """
        self._readers.forget(path)
        self._inodes.pop(path, None)

    @contextlib.contextmanager
    def _walk(self, path: Path) -> Iterator[tuple[Any, Any, Any] | None]:
        """Like ``_txn``, but through a handle closed afterwards.

        A walk of every page must not leave the file mapped (its pages would count as the server's
        resident memory).
        """
        with self._writes.lock(path):
            handle = self._writes.get(path)
            if handle is not None:
                with handle.env.begin(db=handle.db) as txn:
                    yield txn, handle.db, handle.env
                return
            if not os.path.lexists(path):
                yield None
                return
            self.forget(path)
            env = nemo_format.open_env(path, write=False)
            try:
                db = nemo_format.open_completed_db(path, env)
                if db is None:
                    yield None
                    return
                with env.begin(db=db) as txn:
                    yield txn, db, env
            finally:
                env.close()

    def _vouch(self, path: Path, txn: Any, db: Any, env: Any) -> bool:
        """Check the file's pages before a cursor walk; True: its keys were read from them (whole).

        Raises:
            DamagedFileError: the file is damaged (see ``nemo_format.check_pages``); nothing may walk it.
        """
        return nemo_format.check_pages(path, txn, db, env)

    def check_tree(self, path: Path, env: Any, db: Any) -> None:
        """Raise if the file is damaged: checked from its pages, or by a cursor walk of every key.

        What a write handle (or a load of every id) does before using a file; the caller holds
        the file's lock.

        Raises:
            READ_ERRORS: the file is damaged (a key that is not UTF-8 counts as damage).
        """
        inode = _inode(path)
        with env.begin(db=db) as txn:
            if not self._vouch(path, txn, db, env):
                with txn.cursor(db=db) as cursor:
                    for key in cursor.iternext(keys=True, values=False):
                        key.decode()
        self._vouched[path] = inode

    @contextlib.contextmanager
    def _txn(self, path: Path) -> Iterator[tuple[Any, Any, Any] | None]:
        """A read transaction on ``path`` and its database, under the file's lock.

        None if the file is missing or holds no ``completed_sources`` database. The handle was
        opened on a file whose pages were checked (here, or by the writer that holds it open), so
        a cursor may search and step through it.

        Raises:
            READ_ERRORS: the file cannot be read.
        """
        with self._writes.lock(path):
            handle = self._writes.get(path)
            if handle is None:
                handle = self._reader(path)
            if handle is None:
                yield None
                return
            try:
                txn = handle.env.begin(db=handle.db)
            except lmdb.MapResizedError:  # the file grew past this read handle's map
                self._readers.forget(path)
                handle = self._reader(path)
                if handle is None:
                    yield None
                    return
                txn = handle.env.begin(db=handle.db)
            with txn:
                yield txn, handle.db, handle.env

    def _reader(self, path: Path) -> OpenFile | None:
        """The read-only handle of ``path`` (the caller holds its lock), opened if needed."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._readers.forget(path)
            return None
        cached = self._readers.get(path)
        if cached is not None and self._inodes.get(path) == (st.st_dev, st.st_ino):
            return cached
        self._readers.forget(path)
        env = nemo_format.open_env(path, write=False, readahead=False)
        try:
            db = nemo_format.open_completed_db(path, env)
            if db is not None and self._vouched.get(path) != (st.st_dev, st.st_ino):
                # Not read whole at this inode (replaced since it was loaded): a lookup's search
                # trusts page types too (LMDB asserts on a leaf marked as a branch), so check first.
                with env.begin(db=db) as txn:
                    if self._vouch(path, txn, db, env):
                        self._vouched[path] = (st.st_dev, st.st_ino)
        except BaseException:
            env.close()
            raise
        if db is None:
            env.close()
            return None
        handle = OpenFile(env=env, db=db)
        self._inodes[path] = (st.st_dev, st.st_ino)
        self._readers.put(path, handle)
        return handle

    def hash_keys(self, path: Path, hasher: Hasher) -> U64:
        """The hash of every key in the file, in no particular order.

        Read from the file's pages with array operations where ``lmdb_pages`` can vouch for the
        whole tree against what LMDB says of it. A tree it finds damaged raises without being
        walked; otherwise a full cursor walk, so other damage raises here as LMDB reports it.

        Raises:
            READ_ERRORS: the file cannot be read (a key that is not UTF-8 counts as damage).
        """
        parts: list[U64] = []
        with self._walk(path) as opened:
            if opened is None:
                return np.empty(0, dtype=np.uint64)
            txn, db, env = opened
            inode = _inode(path)
            fast = _hash_pages(path, txn, db, env, hasher)
            if fast is not None:
                self._vouched[path] = inode
                return fast
            with txn.cursor(db=db) as cursor:
                keys = cursor.iternext(keys=True, values=False)
                while chunk := list(itertools.islice(keys, _LOAD_CHUNK)):
                    if not b"".join(chunk).isascii():
                        for key in chunk:
                            key.decode()
                    parts.append(hasher.of_keys(chunk, len(chunk)))
            self._vouched[path] = inode
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)

    def hash_files(self, paths: Sequence[Path], hasher: Hasher) -> list[U64 | BaseException]:
        """``hash_keys`` of each file (unsorted), or the error that made the file unreadable."""

        def read(path: Path) -> U64 | BaseException:
            try:
                return self.hash_keys(path, hasher)
            except READ_ERRORS as exc:
                return exc

        # One thread: two gained about 10 % at 10 M ids on two quiet cores (numpy lets go of the GIL
        # while hashing) but leave a second malloc arena resident: 5-11 MB more at 10 M ids, and no
        # faster at loads of 3.5-6 (2026-12-05; with MALLOC_MMAP_THRESHOLD_ at 1 MiB, 0.6 MB more
        # but 25 % more CPU). Measured, see bench/README.md ("Loading ids").
        return [read(path) for path in paths]

    def merged_keys_after(self, paths: Sequence[Path], after: bytes, limit: int) -> tuple[list[bytes], bool]:
        """Up to ``limit`` distinct keys of these files after ``after``, in key order.

        Also says whether those are the last. Each round reads a few keys of every file and keeps
        those up to the smallest last key of a file that has more.
        """
        per_file = max(64, 2 * limit // max(1, len(paths)) + 16)
        out: list[bytes] = []
        cursor = after
        while True:
            found: set[bytes] = set()
            frontier: bytes | None = None
            for path in paths:
                keys, more = self.keys_after(path, cursor, per_file)
                found.update(keys)
                if more and (frontier is None or keys[-1] < frontier):
                    frontier = keys[-1]
            out.extend(sorted(k for k in found if frontier is None or k <= frontier))
            if frontier is None:
                return out[:limit], len(out) <= limit
            if len(out) > limit:
                return out[:limit], False
            cursor = frontier

    def keys_matching(self, path: Path, wanted: Callable[[bytes], bool]) -> list[bytes]:
        """The keys of the file for which ``wanted`` is true (unreadable file: none)."""
        try:
            with self._walk(path) as opened:
                if opened is None:
                    return []
                txn, db, env = opened
                inode = _inode(path)
                if self._vouched.get(path) != inode:  # read whole by the load just before, mostly
                    self._vouch(path, txn, db, env)
                with txn.cursor(db=db) as cursor:
                    found = [k for k in cursor.iternext(keys=True, values=False) if wanted(k)]
                self._vouched[path] = inode
                return found
        except READ_ERRORS as exc:
            logger.warning("cannot read completion file %s: %s", path, describe_error(exc, path))
            return []

    def contains(self, path: Path, keys: Sequence[bytes]) -> list[bool]:
        """Whether the file holds each key; a file that cannot be read holds none."""
        try:
            with self._txn(path) as opened:
                if opened is None:
                    return [False] * len(keys)
                txn, db, _ = opened
                # A lookup searches from the root: LMDB checks each page's type on that path.
                with txn.cursor(db=db) as cursor:  # one cursor: no value copied out, no Python loop
                    return list(map(cursor.set_key, keys))
        except READ_ERRORS as exc:
            logger.warning("cannot read completion file %s: %s", path, describe_error(exc, path))
            return [False] * len(keys)

    def keys_after(self, path: Path, after: bytes, limit: int) -> tuple[list[bytes], bool]:
        """Up to ``limit`` keys greater than ``after`` in key order, and whether more follow."""
        try:
            with self._txn(path) as opened:
                if opened is None:
                    return [], False
                txn, db, _ = opened  # a handle opens on a checked file (``_reader``, the writer's)
                with txn.cursor(db=db) as cursor:
                    if not cursor.set_range(after):
                        return [], False
                    keys = cursor.iternext(keys=True, values=False)
                    out = list(itertools.islice(keys, limit + 2))
        except READ_ERRORS as exc:
            logger.warning("cannot read completion file %s: %s", path, describe_error(exc, path))
            return [], False
        if out and out[0] == after:
            del out[0]
        return out[:limit], len(out) > limit


def _inode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino
