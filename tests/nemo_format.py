"""NeMo Curator 1.4.0's checkpoint-file handling, copied for the tests (no NeMo Curator install needed).

``nemo_open``, ``NemoWriter`` and ``nemo_read`` copy ``nemo_curator.utils.resumability_actor.
ResumabilityActor`` (open flags, database name, keys, values, the loader's error handling) with Ray
and loguru left out. Every test that writes or reads a folder "the NeMo way" uses these.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import lmdb

logger = logging.getLogger(__name__)

COMPLETED_DB = b"completed_sources"
DEFAULT_MAP_SIZE = 1 << 30
METADATA_DIRNAME = ".nemo_curator_metadata"


def nemo_open(path: Path | str) -> lmdb.Environment:
    """The actor's ``lmdb.open`` of its own file."""
    return lmdb.open(
        str(path),
        subdir=False,
        lock=False,  # sole writer of this file
        max_dbs=1,
        map_size=DEFAULT_MAP_SIZE,
        metasync=False,
        sync=True,
        readahead=False,
    )


class NemoWriter:
    """ResumabilityActor's file handling: open, _persist_completed, _remove_from_completed."""

    def __init__(self, base_dir: Path, writer_id: str) -> None:
        folder = Path(base_dir).absolute() / METADATA_DIRNAME
        folder.mkdir(parents=True, exist_ok=True)
        self._env = nemo_open(folder / f"{writer_id}.mdb")
        self._db = self._env.open_db(COMPLETED_DB)

    def persist_completed(self, sids: Iterable[str]) -> None:
        with self._env.begin(write=True) as txn:
            for sid in sids:
                txn.put(sid.encode(), b"1", db=self._db, overwrite=True)

    def remove_from_completed(self, sid: str) -> None:
        with self._env.begin(write=True) as txn:
            txn.delete(sid.encode(), db=self._db)

    def close(self) -> None:
        self._env.close()


def nemo_write(path: Path, sources: Iterable[str]) -> None:
    """Write ``sources`` into the file ``path`` as the actor does, then close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    env = nemo_open(path)
    try:
        db = env.open_db(COMPLETED_DB)
        with env.begin(write=True) as txn:
            for sid in sources:
                txn.put(sid.encode(), b"1", db=db, overwrite=True)
    finally:
        env.close()


def _read_completed_from(env: lmdb.Environment) -> set[str]:
    try:
        db = env.open_db(COMPLETED_DB)
    except lmdb.Error:
        return set()  # a file with no completions database yet
    with env.begin() as txn, txn.cursor(db=db) as cur:
        return {k.decode() for k, _ in cur}


def nemo_read_file(path: Path) -> set[str]:
    """The ids in one completion file, read without holding it (its writer must have closed it)."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        return _read_completed_from(env)
    finally:
        env.close()


def nemo_read(checkpoint_dir: Path) -> set[str]:
    """ResumabilityActor._load_completed for a reader that owns no file of its own: the union of
    every ``*.mdb``, skipping unreadable files with a warning."""
    done: set[str] = set()
    for mdb in sorted((Path(checkpoint_dir).absolute() / METADATA_DIRNAME).glob("*.mdb")):
        try:
            env = lmdb.open(str(mdb), subdir=False, readonly=True, lock=False, max_dbs=1)
        except lmdb.Error as e:
            logger.warning("resumability: skipping unreadable checkpoint %s: %s", mdb, e)
            continue
        try:
            done |= _read_completed_from(env)
        finally:
            env.close()
    return done
