"""One coordinator per data directory: an exclusive lock held for the life of ``tally serve``.

Two coordinators on one data directory would both write its completion files (LMDB without a
lock table: each would corrupt what the other writes) and both answer for its checkpoints. The
lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<data_dir>/.tally.lock``. The kernel releases it when
the process ends however it ends (kill -9 included), so a lock file left behind never blocks a
restart; the file only carries the holder's details for the refusal message.

On a shared filesystem the lock holds across hosts where the filesystem supports ``flock``
(NFSv4, Lustre mounted with ``-o flock``, GPFS, CephFS). Where it is local to one host (Lustre's
``-o localflock``) or refused (Lustre without either option), keep two hosts from serving one
directory by other means; where it is refused, ``tally serve`` logs a warning and runs unlocked
rather than not at all.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_FILENAME = ".tally.lock"
# flock refused by the filesystem itself (not "held by someone else").
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class DataDirInUse(OSError):
    """Another live process holds the data directory's lock.

    An ``OSError`` so that ``tally serve`` reports it as one line and exits non-zero, like a
    port already in use.
    """

    def __init__(self, data_dir: Path, holder: dict[str, Any]) -> None:
        pid = holder.get("pid", "?")
        host = holder.get("host", "?")
        started = holder.get("started_at")
        when = (
            datetime.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")
            if isinstance(started, int | float)
            else "an unknown time"
        )
        super().__init__(
            f"data directory {data_dir} is in use by another tally serve (pid {pid} on host {host}, "
            f"started {when}); stop that one first, or give this one another --data-dir"
        )
        self.data_dir = data_dir
        self.holder = holder


class DataDirLock:
    """The exclusive lock on a data directory, held from ``acquire`` until ``release`` or exit.

    Args:
        data_dir: the data directory (created if missing).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILENAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and record this process as its holder.

        Raises:
            DataDirInUse: another process holds it.
            OSError: the directory or the lock file cannot be created.
        """
        if self._fd is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted at the lock's name is refused, never created through.
        # O_CLOEXEC: a child process must not inherit (and so keep) the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    logger.warning(
                        "cannot lock the data directory %s (%s): this filesystem refuses flock, so a "
                        "second coordinator on it would not be refused; make sure only one runs",
                        self.data_dir,
                        os.strerror(exc.errno or 0),
                    )
                elif exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise DataDirInUse(self.data_dir, _read_holder(fd)) from None
                else:
                    raise
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (closing the file releases it). Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
