"""Completion files in NeMo Curator 1.4.0's on-disk format (DESIGN §3).

``<data_dir>/checkpoints/<checkpoint>/.nemo_curator_metadata/<writer_id>.mdb``: one LMDB file
per writer, one named database ``b"completed_sources"``, key = source id (UTF-8), value ``b"1"``.
The folder below ``<data_dir>/checkpoints/<checkpoint>`` is exactly what NeMo Curator's
``pipeline.run(checkpoint_path=...)`` reads and writes, so export and import are folder copies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import lmdb

from tally.integrations import nemo_format
from tally.integrations.nemo_format import (
    DAMAGE_ERRORS,
    FILE_SUFFIX,
    NEMO_MAP_SIZE,
    READ_ERRORS,
    describe_error,
)
from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    DeleteCompleted,
    PutCompleted,
    QuarantinedFile,
)
from tally_server.store.disk import make_dirs, move_to_trash, quarantine, write_error
from tally_server.store.file_handles import OpenFile
from tally_server.store.lmdb_queries import CompletionFolders

logger = logging.getLogger(__name__)

DEFAULT_MAP_SIZE = NEMO_MAP_SIZE
# Each writable LMDB handle costs two file descriptors and map_size of address space; with
# thousands of writers (SLURM arrays) keeping all open would hit the usual 1024-fd limit.
DEFAULT_MAX_OPEN_FILES = 256
# A new writer file is built as `.<writer_id>.mdb.tmp-coordinator` (see _create).
TEMP_TAG = "coordinator"
# How many files one commit writes side by side (each write ends in its own fsync).
DEFAULT_COMMIT_THREADS = 8

T = TypeVar("T")


class LmdbCompletionStore(CompletionFolders):
    """NeMo Curator-compatible completion files, one LMDB file per writer.

    The coordinator is the only process that writes these files, so, as in NeMo Curator, LMDB's
    inter-process lock table is off (``lock=False``). Without that table LMDB cannot see readers,
    and a writer may recycle pages a concurrent reader is still walking; a lock per file therefore
    serialises every transaction on a file inside this process (``commit`` runs on one thread,
    ``load`` and ``exists`` on others).

    Write handles stay open between commits (least recently used first out beyond
    ``max_open_files``) and are closed when their writer closes (``release_files``); reads of a
    file with an open write handle go through that handle.

    Damage never turns into "no completions": a file that cannot be read is listed unreadable
    and not counted, links are never followed, and a writer's own file that cannot be written
    is quarantined into ``<data_dir>/.trash`` so that the writer continues in a fresh file. New
    files are built aside and renamed into place, so a full disk or a crash never leaves a
    half-made file under a ``*.mdb`` name.

    Reads (loads, lookups, pages of ids) are :class:`CompletionFolders`'; this class adds writes.

    Args:
        data_dir: the server's data directory; files live under ``<data_dir>/checkpoints``.
        map_size: initial LMDB map size of files opened for writing (grown on demand).
        max_open_files: how many write handles to keep open.
    """

    remote = False  # lookups read the memory-mapped files of this process

    def __init__(
        self,
        data_dir: Path,
        map_size: int = DEFAULT_MAP_SIZE,
        *,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
    ) -> None:
        super().__init__(data_dir, max_open_files)
        self._map_size = map_size
        # Files being written cannot be evicted, so side-by-side writes stay well under the bound.
        self._parallel = max(1, min(DEFAULT_COMMIT_THREADS, max_open_files // 8))
        self._pool = ThreadPoolExecutor(self._parallel, thread_name_prefix="tally-file-commit")

    # ----------------------------------------------------------------- writes

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        """Apply ``ops`` as if one after another, with one synced write transaction per file.

        ``PutCompleted`` writes the writer's own file, creating folder and file if needed (a new
        file is built aside and renamed into place, so it is never left half made). An own file
        that is damaged, a link or not a regular file is quarantined: moved (never deleted) to
        ``<data_dir>/.trash/<checkpoint>/quarantine-<stamp>/`` and replaced by a fresh file; the
        returned report lists it. ``DeleteCompleted`` removes the ids from every ``*.mdb`` of the
        checkpoint, including files of other writers and files Tally did not write; a file that
        cannot be opened is skipped with a warning (its contents are never counted anyway).

        Raises:
            ValueError: a checkpoint name or writer id that would leave the data directory, or a
                source id over LMDB's key limit; raised before anything is written.
            CompletionWriteError: a file could not be written (full disk, I/O error, ...).
        """
        self._handles.check_open()
        puts, deletes = _plan(ops)
        # Resolve every path first so that a bad name cannot leave a commit half applied.
        folders = {name: self._folder(name) for name in sorted({c for c, _ in puts} | deletes.keys())}
        targets = {(c, w): self._writer_file(folders[c], w) for c, w in puts}
        report = CommitReport()

        # One job per file; each commits (and fsyncs) on its own, so files are written side by
        # side: the fsyncs overlap instead of queueing one behind another.
        jobs: list[Callable[[], QuarantinedFile | None]] = []
        for checkpoint, folder in folders.items():
            removed = deletes.get(checkpoint, set())
            own = {targets[c, w]: (w, changes) for (c, w), changes in puts.items() if c == checkpoint}
            if own:
                try:
                    make_dirs(folder)
                except OSError as exc:
                    raise write_error(folder, exc, self._data_dir) from exc
            for path, (writer_id, changes) in sorted(own.items()):
                # The checkpoint-wide deletes hit this file too, unless a later put re-adds the id.
                merged = dict.fromkeys(removed, False)
                merged.update(changes)
                jobs.append(functools.partial(self._write_own, checkpoint, writer_id, path, merged))
            if removed and folder.is_dir():
                for path in sorted(folder.glob(f"*{FILE_SUFFIX}")):
                    if path not in own:
                        jobs.append(functools.partial(self._remove_from, checkpoint, path, removed))
        report.quarantined.extend(q for q in self._run_jobs(jobs) if q is not None)
        return report

    def _run_jobs(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """Run per-file jobs side by side; every job runs to its end, then the first error raises.

        A failed file leaves the others committed, as a sequential commit stopping at it would
        have left the ones before it: the caller retries the whole group, and both puts and
        deletes are idempotent.
        """
        if len(jobs) <= 1 or self._parallel <= 1:
            return [job() for job in jobs]
        futures = [self._pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]

    def _write_own(
        self, checkpoint: str, writer_id: str, path: Path, changes: dict[bytes, bool]
    ) -> QuarantinedFile | None:
        quarantined: QuarantinedFile | None = None
        with self._handles.lock(path):
            while True:
                try:
                    handle = self._writable(path, create=True)
                    assert handle is not None  # create=True always yields a handle
                    nemo_format.apply_changes(handle.env, handle.db, changes)
                    return quarantined
                except DAMAGE_ERRORS as exc:
                    self._handles.forget(path)
                    if quarantined is not None:  # the fresh file failed too: not the file's fault
                        raise write_error(path, exc, self._data_dir) from exc
                    quarantined = quarantine(self._data_dir, checkpoint, writer_id, path, exc)
                except (lmdb.Error, OSError) as exc:
                    # A failed write can leave LMDB's handle unusable (MDB_PANIC after a failed
                    # meta write): the next commit reopens the file instead.
                    self._handles.forget(path)
                    raise write_error(path, exc, self._data_dir) from exc

    def _remove_from(self, checkpoint: str, path: Path, keys: Iterable[bytes]) -> None:
        with self._handles.lock(path):
            try:
                handle = self._writable(path, create=False)
            except READ_ERRORS as exc:
                logger.warning(
                    "checkpoint %r: cannot un-complete sources in unreadable file %s: %s",
                    checkpoint,
                    path,
                    describe_error(exc, path),
                )
                return
            if handle is None:
                return  # no completed_sources database: nothing to remove
            try:
                nemo_format.apply_changes(handle.env, handle.db, dict.fromkeys(keys, False))
            except (lmdb.Error, OSError) as exc:
                # A readable file that still holds the ids would resurrect them on the next load.
                self._handles.forget(path)
                raise write_error(path, exc, self._data_dir) from exc

    def _writable(self, path: Path, *, create: bool) -> OpenFile | None:
        """The cached write handle of ``path``, opening it (with NeMo Curator's flags) if needed.

        A missing file is created (atomically) only with ``create=True``. With ``create=False``
        a missing file, or one lacking the completed_sources database, is left untouched and None
        is returned. Every id is read once on opening (from the checked pages, or by a
        cursor walk), so a damaged tree is found before anything is written into it. The caller
        holds the file's lock.

        Raises:
            DAMAGE_ERRORS: the file is damaged, a link, or not a regular file.
            lmdb.Error, OSError: the disk or the system refused.
        """
        cached = self._handles.get(path)
        if cached is not None:
            return cached
        if not os.path.lexists(path):
            if not create:
                return None
            self._create(path)
        # LMDB refuses a second handle on a file this process has open: a read-only handle kept
        # for lookups goes first (reads go through the write handle from now on).
        self._reads.forget(path)
        env = nemo_format.open_env(path, write=True, map_size=self._map_size)
        try:
            db = nemo_format.open_completed_db(path, env, create=create)
            if db is None:
                env.close()
                return None
            self._reads.check_tree(path, env, db)
        except BaseException:
            env.close()
            raise
        handle = OpenFile(env=env, db=db)
        self._handles.put(path, handle)
        return handle

    def probe(self) -> None:
        """Write, sync and remove a page-sized file under the checkpoints folder.

        Tells whether completions can be written again after a failure (a full disk): the
        coordinator reports itself not ready until this succeeds.

        Raises:
            CompletionWriteError: the disk or the system refused (saying so plainly when it is full).
        """
        self._handles.check_open()
        path = self._root / f".probe-{os.getpid()}"
        try:
            make_dirs(self._root)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise write_error(path, exc, self._data_dir, what="probe file") from exc
        finally:
            path.unlink(missing_ok=True)

    def _create(self, path: Path) -> None:
        """Create an empty writer file atomically; the caller holds the file's lock."""
        # A fixed name rather than a random one: this process holds the data directory's lock and
        # `path`'s lock, so whatever is found there was left by a coordinator that crashed while
        # creating this file; it never held an acknowledged completion, and replacing it here
        # needs no listing of a folder that may hold thousands of writer files.
        temp = nemo_format.temp_name(path, TEMP_TAG)
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        nemo_format.create_file(path, map_size=self._map_size, temp=temp)

    # -------------------------------------------------------------- lifecycle

    def release(self, checkpoint: str) -> None:
        """Close the cached handles of one checkpoint's files; the next write opens them again.

        ``trash`` calls it before moving the folder, or later puts would land in the moved files
        through the open handles.
        """
        folder = self._folder(checkpoint)
        self._lookup_paths.clear()
        self._handles.drop_folder(folder)
        self._reads.drop_folder(folder)

    def release_files(self, checkpoint: str, writer_id: str | None = None) -> None:
        """Close the write handles of the checkpoint's files (of ``writer_id``'s file only, if given).

        A writer's close calls it: open, a handle keeps LMDB's page lists (13-127 KB once its writer
        wrote 25,000 ids, by commit size; bench/README.md), and the file of a writer that
        closed is written again only if an anomaly un-completes one of its sources or the same
        writer id opens again; either opens it again (a check of its pages, as at any open). Read
        handles stay: they hold no such lists. Nothing to do once the store is closed.
        """
        try:
            self._handles.check_open()
        except RuntimeError:
            return
        folder = self._folder(checkpoint)
        if writer_id is None:
            self._handles.drop_folder(folder)
        else:
            self._handles.drop(self._writer_file(folder, writer_id), wait=True)

    def trash(self, checkpoint: str, stamp: str) -> tuple[str, int]:
        """Move the checkpoint's metadata folder to ``<data_dir>/.trash/<checkpoint>/<stamp>/``.

        Never deletes: a reset can be undone by moving the folder back.
        """
        self._handles.check_open()
        folder = self._folder(checkpoint)
        self.release(checkpoint)
        if not folder.exists():
            return "", 0
        return move_to_trash(self._data_dir, folder, checkpoint, stamp)

    def close(self) -> None:
        """Close every cached file handle; the store refuses further calls. Idempotent."""
        self._reads.close()
        self._handles.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LmdbCompletionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plan(
    ops: Sequence[CompletionOp],
) -> tuple[dict[tuple[str, str], dict[bytes, bool]], dict[str, set[bytes]]]:
    """Fold ``ops`` into their net effect: per writer file, id -> present.

    Per checkpoint, the ids deleted from every file.

    A delete overrides earlier puts of the same id (it rewrites them to absent in the files
    already planned), and a later put overrides the delete for its own file (its entry is laid
    over the checkpoint-wide deletes when applied) — the same final state as applying the ops
    one after another.
    """
    puts: dict[tuple[str, str], dict[bytes, bool]] = {}
    deletes: dict[str, set[bytes]] = {}
    for op in ops:
        keys = [nemo_format.encode_key(sid) for sid in op.sources]
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
