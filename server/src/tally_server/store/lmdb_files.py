"""Completion files in NeMo Curator 1.4.0's on-disk format (DESIGN §3).

``<data_dir>/checkpoints/<checkpoint>/.nemo_curator_metadata/<writer_id>.mdb``: one LMDB file
per writer, one named database ``b"completed_sources"``, key = source id (UTF-8), value ``b"1"``.
The folder below ``<data_dir>/checkpoints/<checkpoint>`` is exactly what NeMo Curator's
``pipeline.run(checkpoint_path=...)`` reads and writes, so export and import are folder copies.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from tally_server.domain.ports import (
    CompletionOp,
    DeleteCompleted,
    LoadedCheckpoint,
    PutCompleted,
    UnreadableFile,
)

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
METADATA_DIRNAME = ".nemo_curator_metadata"
COMPLETED_DB = b"completed_sources"
COMPLETED_VALUE = b"1"
FILE_SUFFIX = ".mdb"
DEFAULT_MAP_SIZE = 1 << 30
# Each writable LMDB handle costs two file descriptors and map_size of address space; with
# thousands of writers (SLURM arrays) keeping all open would hit the usual 1024-fd limit.
DEFAULT_MAX_OPEN_FILES = 256

# LMDB's compiled-in key limit (mdb_env_get_maxkeysize); a longer source id cannot be stored.
MAX_KEY_BYTES = 511

# A full map is grown by doubling; this bounds a runaway (1 GiB doubled 8 times is 256 GiB).
_MAX_MAP_GROWTHS = 8


class CompletionWriteError(Exception):
    """A completion file could not be written; the commit did not become durable.

    Files earlier in the same ``commit`` call may already be committed; applying the same ops
    again is safe because every op sets a final state (put = present, delete = absent).
    """

    def __init__(self, path: Path, error: BaseException) -> None:
        super().__init__(f"cannot write completion file {path}: {_describe_error(error)}")
        self.path = str(path)


class _DamagedFileError(Exception):
    """The file is shorter than its own LMDB header says: reading it would fault (SIGBUS)."""


@dataclass
class _OpenFile:
    env: Any  # lmdb.Environment (lmdb ships no type information)
    db: Any  # its b"completed_sources" database handle


# Errors that mean "this file cannot be opened or read"; everything else is a bug and propagates.
_UNREADABLE_ERRORS = (lmdb.Error, OSError, UnicodeDecodeError, _DamagedFileError)


class LmdbCompletionStore:
    """NeMo Curator-compatible completion files, one LMDB file per writer.

    The coordinator is the only process that writes these files, so, as in NeMo Curator, LMDB's
    inter-process lock table is off (``lock=False``). Without that table LMDB cannot see readers,
    and a writer may recycle pages a concurrent reader is still walking; a lock per file therefore
    serialises every transaction on a file inside this process (``commit`` runs on one thread,
    ``load`` and ``exists`` on others).

    Write handles stay open between commits (least recently used first out beyond
    ``max_open_files``); reads of a file with an open write handle go through that handle.

    Args:
        data_dir: the server's data directory; files live under ``<data_dir>/checkpoints``.
        map_size: initial LMDB map size of files opened for writing (grown on demand).
        max_open_files: how many write handles to keep open.
    """

    def __init__(
        self,
        data_dir: Path,
        map_size: int = DEFAULT_MAP_SIZE,
        *,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
    ) -> None:
        self._root = (Path(data_dir) / CHECKPOINTS_DIRNAME).resolve()
        self._map_size = map_size
        self._max_open_files = max(1, max_open_files)
        self._lock = threading.Lock()  # guards the three fields below, never held during I/O
        # Keyed by resolved file path rather than (checkpoint, writer_id) so that two names that
        # reach the same file (a symlinked checkpoint folder) can never get two write handles.
        # Insertion order is use order: the first entry is the least recently used.
        self._envs: dict[Path, _OpenFile] = {}
        self._file_locks: dict[Path, threading.Lock] = {}
        self._closed = False

    # ------------------------------------------------------------------ reads

    def exists(self, checkpoint: str) -> bool:
        """Whether the checkpoint's ``.nemo_curator_metadata`` folder exists (creates nothing).

        The metadata folder, not the checkpoint folder, is the marker: ``a/b`` nests inside the
        folder of ``a``, which must not make ``a`` look like it exists.
        """
        self._check_open()
        return self._folder(checkpoint).is_dir()

    def load(self, checkpoint: str) -> LoadedCheckpoint:
        """Union of every ``*.mdb`` in the checkpoint's metadata folder.

        ``files`` lists the files that were read and counted; ``unreadable`` lists the files that
        could not be read (with the error), whose contents are never counted. A missing folder
        gives an empty result and creates nothing.
        """
        self._check_open()
        folder = self._folder(checkpoint)
        result = LoadedCheckpoint(completed=set(), files=[], unreadable=[])
        if not folder.is_dir():
            return result
        for path in sorted(folder.glob(f"*{FILE_SUFFIX}")):
            try:
                with self._file_lock(path):
                    sources = self._read(path)
            except _UNREADABLE_ERRORS as exc:
                # lmdb's messages start with the path, which the log line already names.
                error = _describe_error(exc).replace(f"{path}: ", "")
                logger.warning(
                    "checkpoint %r: skipping unreadable completion file %s: %s", checkpoint, path, error
                )
                result.unreadable.append(UnreadableFile(path=str(path), error=error))
                continue
            result.completed |= sources
            result.files.append(str(path))
        return result

    def _read(self, path: Path) -> set[str]:
        """Completed ids in one file; the caller holds the file's lock."""
        cached = self._cached(path)
        if cached is not None:
            # Never open a second handle on a file this process holds open for writing.
            return _read_sources(cached.env, cached.db)
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
        try:
            _check_whole(env, path)
            try:
                db = env.open_db(COMPLETED_DB)
            except lmdb.Error:
                return set()  # NeMo Curator's reading: no database yet means nothing completed
            return _read_sources(env, db)
        finally:
            env.close()

    # ----------------------------------------------------------------- writes

    def commit(self, ops: Sequence[CompletionOp]) -> None:
        """Apply ``ops`` as if one after another, with one synced write transaction per file.

        ``PutCompleted`` writes the writer's own file, creating folder and file if needed.
        ``DeleteCompleted`` removes the ids from every ``*.mdb`` of the checkpoint, including
        files of other writers and files Tally did not write; a file that cannot be opened is
        skipped with a warning (its contents are never counted anyway).

        Raises:
            ValueError: a checkpoint name or writer id that would leave the data directory, or a
                source id over LMDB's key limit; raised before anything is written.
            CompletionWriteError: a file could not be written.
        """
        self._check_open()
        puts, deletes = _plan(ops)
        # Resolve every path first so that a bad name cannot leave a commit half applied.
        folders = {name: self._folder(name) for name in sorted({c for c, _ in puts} | deletes.keys())}
        targets = {(c, w): self._writer_file(folders[c], w) for c, w in puts}

        for checkpoint, folder in folders.items():
            removed = deletes.get(checkpoint, set())
            own = {targets[c, w]: changes for (c, w), changes in puts.items() if c == checkpoint}
            if own:
                _make_dirs(folder)
            for path, changes in sorted(own.items()):
                # The checkpoint-wide deletes hit this file too, unless a later put re-adds the id.
                merged = dict.fromkeys(removed, False)
                merged.update(changes)
                self._write_own(path, merged)
            if removed and folder.is_dir():
                for path in sorted(folder.glob(f"*{FILE_SUFFIX}")):
                    if path not in own:
                        self._remove_from(checkpoint, path, removed)

    def _write_own(self, path: Path, changes: dict[bytes, bool]) -> None:
        with self._file_lock(path):
            try:
                handle = self._writable(path, create=True)
                assert handle is not None  # create=True always yields a handle
                _write(handle, changes)
            except (lmdb.Error, OSError, _DamagedFileError) as exc:
                raise CompletionWriteError(path, exc) from exc

    def _remove_from(self, checkpoint: str, path: Path, keys: Iterable[bytes]) -> None:
        with self._file_lock(path):
            try:
                handle = self._writable(path, create=False)
            except (lmdb.Error, OSError, _DamagedFileError) as exc:
                logger.warning(
                    "checkpoint %r: cannot un-complete sources in unreadable file %s: %s",
                    checkpoint,
                    path,
                    _describe_error(exc),
                )
                return
            if handle is None:
                return  # no completed_sources database: nothing to remove
            try:
                _write(handle, dict.fromkeys(keys, False))
            except lmdb.Error as exc:
                # A readable file that still holds the ids would resurrect them on the next load.
                raise CompletionWriteError(path, exc) from exc

    def _writable(self, path: Path, *, create: bool) -> _OpenFile | None:
        """The cached write handle of ``path``, opening it (with NeMo Curator's flags) if needed.

        With ``create=False`` a file lacking the completed_sources database is left untouched
        and None is returned. The caller holds the file's lock.
        """
        cached = self._cached(path)
        if cached is not None:
            return cached
        if not create and not path.exists():
            return None
        is_new = not path.exists()
        env = lmdb.open(
            str(path),
            subdir=False,
            lock=False,
            max_dbs=1,
            map_size=self._map_size,
            metasync=False,
            sync=True,
            readahead=False,
        )
        try:
            _check_whole(env, path)
            db = env.open_db(COMPLETED_DB, create=create)
        except lmdb.NotFoundError:
            env.close()
            return None
        except BaseException:
            env.close()
            raise
        if is_new:
            _fsync_dir(path.parent)  # the new directory entry must survive a power loss too
        handle = _OpenFile(env=env, db=db)
        surplus: list[Path] = []
        with self._lock:
            closed = self._closed
            if not closed:
                self._envs[path] = handle
                surplus = list(self._envs)[: max(0, len(self._envs) - self._max_open_files)]
        if closed:
            env.close()  # close() ran meanwhile: never leave a handle it cannot see
            raise RuntimeError("the completion store is closed")
        for victim in surplus:
            # Never wait here: this thread holds `path`'s lock, and a busy file is simply
            # evicted on a later open.
            self._drop(victim, wait=False)
        return handle

    def probe(self) -> None:
        """Write, sync and remove a page-sized file under the checkpoints folder.

        Tells whether completions can be written again after a failure (a full disk): the
        coordinator reports itself not ready until this succeeds.
        """
        self._check_open()
        _make_dirs(self._root)
        path = self._root / f".probe-{os.getpid()}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            path.unlink(missing_ok=True)

    # -------------------------------------------------------------- lifecycle

    def release(self, checkpoint: str) -> None:
        """Close the cached handles of one checkpoint's files (before they are moved or removed).

        Not part of the ``CompletionStore`` port: a checkpoint reset must call it before moving
        the folder, or later puts would land in the moved files through the open handles.
        """
        folder = self._folder(checkpoint)
        with self._lock:
            paths = [p for p in self._envs if p.parent == folder]
        for path in paths:
            self._drop(path, wait=True)

    def trash(self, checkpoint: str, stamp: str) -> tuple[str, int]:
        """Move the checkpoint's metadata folder to ``<data_dir>/.trash/<checkpoint>/<stamp>/``.

        Never deletes: a reset can be undone by moving the folder back.
        """
        self._check_open()
        folder = self._folder(checkpoint)
        self.release(checkpoint)
        if not folder.exists():
            return "", 0
        data_dir = self._root.parent
        destination = (data_dir / ".trash" / checkpoint / stamp).resolve()
        if not destination.is_relative_to(data_dir / ".trash"):
            raise ValueError(f"trash folder for {checkpoint!r} would be outside {data_dir}; refusing")
        destination.mkdir(parents=True, exist_ok=False)
        files = sum(1 for p in folder.iterdir() if p.is_file())
        folder.rename(destination / METADATA_DIRNAME)
        _fsync_dir(folder.parent)
        _fsync_dir(destination)
        return str(destination.relative_to(data_dir)), files

    def close(self) -> None:
        """Close every cached file handle; the store refuses further calls. Idempotent."""
        with self._lock:
            self._closed = True
            paths = list(self._envs)
        for path in paths:
            self._drop(path, wait=True)

    def __enter__(self) -> LmdbCompletionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the completion store is closed")

    def _cached(self, path: Path) -> _OpenFile | None:
        with self._lock:
            handle = self._envs.pop(path, None)
            if handle is not None:
                self._envs[path] = handle  # now the most recently used
            return handle

    def _drop(self, path: Path, *, wait: bool) -> None:
        """Close the write handle of ``path``, under the file's lock so no reader is using it."""
        lock = self._file_lock(path)
        if not lock.acquire(blocking=wait):
            return
        try:
            with self._lock:
                handle = self._envs.pop(path, None)
            if handle is not None:
                handle.env.close()
        finally:
            lock.release()

    def _file_lock(self, path: Path) -> threading.Lock:
        with self._lock:
            lock = self._file_locks.get(path)
            if lock is None:
                lock = self._file_locks[path] = threading.Lock()
            return lock

    def _folder(self, checkpoint: str) -> Path:
        """The resolved metadata folder of ``checkpoint``, refusing anything outside the root.

        Names are validated upstream; this is defence in depth against a name (or a symlink)
        that would make us read or write outside ``<data_dir>/checkpoints``.
        """
        folder = (self._root / checkpoint / METADATA_DIRNAME).resolve()
        if folder.parent == self._root or not folder.parent.is_relative_to(self._root):
            raise ValueError(
                f"checkpoint {checkpoint!r} resolves to {folder}, outside {self._root}; refusing to touch it"
            )
        return folder

    @staticmethod
    def _writer_file(folder: Path, writer_id: str) -> Path:
        path = folder / f"{writer_id}{FILE_SUFFIX}"
        if not writer_id or writer_id in (".", "..") or path.parent != folder or "/" in writer_id:
            raise ValueError(f"writer_id {writer_id!r} does not name a file in {folder}; refusing")
        return path


def _plan(
    ops: Sequence[CompletionOp],
) -> tuple[dict[tuple[str, str], dict[bytes, bool]], dict[str, set[bytes]]]:
    """Fold ``ops`` into their net effect: per writer file, id -> present; per checkpoint, the
    ids deleted from every file.

    A delete overrides earlier puts of the same id (it rewrites them to absent in the files
    already planned), and a later put overrides the delete for its own file (its entry is laid
    over the checkpoint-wide deletes when applied) — the same final state as applying the ops
    one after another.
    """
    puts: dict[tuple[str, str], dict[bytes, bool]] = {}
    deletes: dict[str, set[bytes]] = {}
    for op in ops:
        keys = [_key(sid) for sid in op.sources]
        if isinstance(op, PutCompleted):
            changes = puts.setdefault((op.checkpoint, op.writer_id), {})
            changes.update(dict.fromkeys(keys, True))
        elif isinstance(op, DeleteCompleted):
            deletes.setdefault(op.checkpoint, set()).update(keys)
            for (checkpoint, _), changes in puts.items():
                if checkpoint == op.checkpoint:
                    changes.update(dict.fromkeys(keys, False))
        else:  # pragma: no cover - guarded by the type checker
            raise TypeError(f"unknown completion op {op!r}")
    return puts, deletes


def _key(source_id: str) -> bytes:
    key = source_id.encode()
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(
            f"source id {source_id[:80]!r} is {len(key)} bytes; LMDB keys must be 1 to {MAX_KEY_BYTES} bytes"
        )
    return key


def _write(handle: _OpenFile, changes: dict[bytes, bool]) -> None:
    """One write transaction for all ``changes``, durable when this returns."""
    for _ in range(_MAX_MAP_GROWTHS + 1):
        changed = False
        try:
            with handle.env.begin(write=True) as txn:
                for key, present in changes.items():
                    if present:
                        txn.put(key, COMPLETED_VALUE, db=handle.db, overwrite=True)
                        changed = True
                    else:
                        changed = txn.delete(key, db=handle.db) or changed
        except lmdb.MapFullError:
            # The aborted transaction left the file untouched; a bigger map keeps it readable
            # by NeMo Curator, whose readers size their map from the file.
            handle.env.set_mapsize(handle.env.info()["map_size"] * 2)
            continue
        if changed:
            # NeMo Curator's flags (metasync=False) fsync the data pages at commit but not the
            # meta page, so a power loss could undo the last transaction. Tally promises
            # durability (a lost un-complete would resurrect a completion), hence the meta sync.
            handle.env.sync(True)
        return
    raise lmdb.MapFullError(f"map still full after {_MAX_MAP_GROWTHS} doublings")


def _read_sources(env: Any, db: Any) -> set[str]:
    with env.begin(db=db) as txn, txn.cursor(db=db) as cursor:
        return {key.decode() for key in cursor.iternext(keys=True, values=False)}


def _check_whole(env: Any, path: Path) -> None:
    """Refuse a file shorter than the pages its meta page claims.

    LMDB maps the file and trusts its header; reading a page past the end of a truncated file
    raises SIGBUS, which would kill the whole coordinator (NeMo Curator's own loader dies so).
    """
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.stat(path).st_size
    if size < needed:
        raise _DamagedFileError(f"{path}: truncated: {size} bytes, but its LMDB header needs {needed}")


def _make_dirs(folder: Path) -> None:
    """``mkdir -p`` that also fsyncs each parent that gained an entry."""
    missing: list[Path] = []
    current = folder
    while not current.exists():
        missing.append(current)
        current = current.parent
    if not missing:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        _fsync_dir(created.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
