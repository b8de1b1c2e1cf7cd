"""What the stores share about the disk.

The error for a write it refused (saying plainly when it is full), ``mkdir -p`` that syncs, and
the trash folder, where damaged files and reset checkpoints are moved (never deleted, so an
operator can inspect or restore them).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

from tally.integrations import nemo_format
from tally.integrations.nemo_format import METADATA_DIRNAME, describe_error, fsync_dir
from tally_server.domain.ports import CompletionWriteError, QuarantinedFile

logger = logging.getLogger(__name__)

TRASH_DIRNAME = ".trash"


def write_error(
    path: Path, error: BaseException, data_dir: Path, what: str = "completion file"
) -> CompletionWriteError:
    """The error for a write the disk or the system refused, saying plainly when the disk is full."""
    disk_full = nemo_format.is_disk_full(error, path.parent)
    message = f"cannot write {what} {path}: {describe_error(error)}"
    if disk_full:
        message = (
            f"the disk holding {data_dir} is full; free space or grow the volume — Tally retries by "
            f"itself ({message})"
        )
    return CompletionWriteError(message, path=str(path), disk_full=disk_full)


def make_dirs(folder: Path) -> None:
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
        fsync_dir(created.parent)


def quarantine(
    data_dir: Path, checkpoint: str, writer_id: str, path: Path, error: BaseException
) -> QuarantinedFile:
    """Move ``path`` (a file, or a link itself: never its target) into the trash.

    The caller holds the file's lock. Never deletes: the operator can inspect or restore it.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{secrets.token_hex(3)}"
    trash = data_dir / TRASH_DIRNAME
    destination = (trash / checkpoint / f"quarantine-{stamp}").resolve()
    if not destination.is_relative_to(trash):
        raise ValueError(f"quarantine folder for {checkpoint!r} would be outside {trash}; refusing")
    moved_to = destination / path.name
    try:
        make_dirs(destination)
        os.rename(path, moved_to)
        fsync_dir(path.parent)
        fsync_dir(destination)
    except OSError as exc:
        raise write_error(path, exc, data_dir) from exc
    text = describe_error(error, path)
    logger.warning(
        "checkpoint %r: completion file %s of writer %r cannot be written (%s); moved it to %s and "
        "continuing in a fresh file (its sources count as not completed)",
        checkpoint,
        path,
        writer_id,
        text,
        moved_to,
    )
    return QuarantinedFile(checkpoint, writer_id, str(path), str(moved_to), text)


def move_to_trash(data_dir: Path, folder: Path, checkpoint: str, stamp: str) -> tuple[str, int]:
    """Move a checkpoint's metadata ``folder`` to ``<data_dir>/.trash/<checkpoint>/<stamp>/``.

    Returns where it went (relative to ``data_dir``) and how many files it held.
    """
    destination = (data_dir / TRASH_DIRNAME / checkpoint / stamp).resolve()
    if not destination.is_relative_to(data_dir / TRASH_DIRNAME):
        raise ValueError(f"trash folder for {checkpoint!r} would be outside {data_dir}; refusing")
    destination.mkdir(parents=True, exist_ok=False)
    files = sum(1 for p in folder.iterdir() if p.is_file())
    folder.rename(destination / METADATA_DIRNAME)
    fsync_dir(folder.parent)
    fsync_dir(destination)
    return str(destination.relative_to(data_dir)), files
