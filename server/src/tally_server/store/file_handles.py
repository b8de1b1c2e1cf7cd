"""Open LMDB write handles of the completion store, and the per-file locks that guard them."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb


@dataclass
class OpenFile:
    """A completion file opened for writing: its LMDB environment and database handle."""

    env: Any  # lmdb.Environment (lmdb ships no type information)
    db: Any  # its b"completed_sources" database handle


class HandleCache:
    """Write handles kept open between commits, least recently used first out beyond ``capacity``.

    LMDB's inter-process lock table is off (as in NeMo Curator), so LMDB cannot see readers and a
    writer may recycle pages a concurrent reader is still walking; every transaction on a file
    therefore runs under that file's lock (``lock(path)``), and a handle is closed only under it.
    """

    def __init__(self, capacity: int, *, locks: HandleCache | None = None) -> None:
        self._capacity = max(1, capacity)
        # Another cache whose per-file locks this one shares (read handles beside write handles).
        self._locks_from = locks
        self._lock = threading.Lock()  # guards the three fields below, never held during I/O
        # Insertion order is use order: the first entry is the least recently used.
        self._handles: dict[Path, OpenFile] = {}
        self._file_locks: dict[Path, threading.Lock] = {}
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)

    def check_open(self) -> None:
        """Refuse calls once the store is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the completion store is closed")

    def lock(self, path: Path) -> threading.Lock:
        """The lock every transaction on ``path`` holds."""
        if self._locks_from is not None:
            return self._locks_from.lock(path)
        with self._lock:
            lock = self._file_locks.get(path)
            if lock is None:
                lock = self._file_locks[path] = threading.Lock()
            return lock

    def get(self, path: Path) -> OpenFile | None:
        """The open handle of ``path``, now the most recently used; the caller holds its lock."""
        with self._lock:
            handle = self._handles.pop(path, None)
            if handle is not None:
                self._handles[path] = handle
            return handle

    def put(self, path: Path, handle: OpenFile) -> None:
        """Keep ``handle`` open; the caller holds ``path``'s lock. Evicts beyond capacity."""
        surplus: list[Path] = []
        with self._lock:
            closed = self._closed
            if not closed:
                self._handles[path] = handle
                surplus = list(self._handles)[: max(0, len(self._handles) - self._capacity)]
        if closed:
            handle.env.close()  # close() ran meanwhile: never leave a handle it cannot see
            raise RuntimeError("the completion store is closed")
        for victim in surplus:
            # Never wait here: this thread holds `path`'s lock, and a busy file is simply
            # evicted on a later open.
            self.drop(victim, wait=False)

    def forget(self, path: Path) -> None:
        """Close the handle of ``path`` if one is open; the caller holds its lock."""
        with self._lock:
            handle = self._handles.pop(path, None)
        if handle is not None:
            with contextlib.suppress(lmdb.Error):
                handle.env.close()

    def drop(self, path: Path, *, wait: bool) -> None:
        """Close the handle of ``path`` under its lock, so no reader is using it."""
        lock = self.lock(path)
        if not lock.acquire(blocking=wait):
            return
        try:
            self.forget(path)
        finally:
            lock.release()

    def drop_folder(self, folder: Path) -> None:
        """Close every handle of a file in ``folder`` (before the folder is moved)."""
        with self._lock:
            paths = [p for p in self._handles if p.parent == folder]
        for path in paths:
            self.drop(path, wait=True)

    def close(self) -> None:
        """Close every handle; later ``check_open`` and ``put`` calls refuse. Idempotent."""
        with self._lock:
            self._closed = True
            paths = list(self._handles)
        for path in paths:
            self.drop(path, wait=True)
