"""Byte compatibility with NeMo Curator 1.4.0's checkpoint folders, both ways (DESIGN §3).

``NemoWriter`` and ``nemo_load_completed`` copy the logic of NeMo Curator 1.4.0's
``nemo_curator.utils.resumability_actor.ResumabilityActor`` (open flags, database name, keys,
values, the loader's error handling) with Ray and loguru left out, so these tests need no
NeMo Curator install.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb
import pytest

from tally_server.domain.ports import DeleteCompleted, PutCompleted
from tally_server.store.lmdb_files import LmdbCompletionStore

logger = logging.getLogger(__name__)

# ---- NeMo Curator 1.4.0, resumability_actor.py --------------------------------------------
_COMPLETED_DB = b"completed_sources"
_DEFAULT_MAP_SIZE = 1 << 30
METADATA_DIRNAME = ".nemo_curator_metadata"


class NemoWriter:
    """ResumabilityActor's file handling: open, _persist_completed, _remove_from_completed."""

    def __init__(self, base_dir: Path, writer_id: str) -> None:
        self._dir = Path(base_dir).absolute() / METADATA_DIRNAME
        self._dir.mkdir(parents=True, exist_ok=True)
        self._path = str(self._dir / f"{writer_id}.mdb")
        self._env = lmdb.open(
            self._path,
            subdir=False,
            lock=False,
            max_dbs=1,
            map_size=_DEFAULT_MAP_SIZE,
            metasync=False,
            sync=True,
            readahead=False,
        )
        self._db = self._env.open_db(_COMPLETED_DB)

    def persist_completed(self, sids: Iterable[str]) -> None:
        with self._env.begin(write=True) as txn:
            for sid in sids:
                txn.put(sid.encode(), b"1", db=self._db, overwrite=True)

    def remove_from_completed(self, sid: str) -> None:
        with self._env.begin(write=True) as txn:
            txn.delete(sid.encode(), db=self._db)

    def close(self) -> None:
        self._env.close()


def _read_completed_from(env: lmdb.Environment) -> set[str]:
    try:
        db = env.open_db(_COMPLETED_DB)
    except lmdb.Error:
        return set()
    with env.begin() as txn, txn.cursor(db=db) as cur:
        return {k.decode() for k, _ in cur}


def nemo_load_completed(base_dir: Path) -> set[str]:
    """ResumabilityActor._load_completed for a reader that owns no file of its own."""
    done: set[str] = set()
    for mdb in sorted((Path(base_dir).absolute() / METADATA_DIRNAME).glob("*.mdb")):
        try:
            env = lmdb.open(str(mdb), subdir=False, readonly=True, lock=False, max_dbs=1)
        except lmdb.Error as e:
            logger.warning(f"resumability: skipping unreadable checkpoint {mdb}: {e}")
            continue
        try:
            done |= _read_completed_from(env)
        finally:
            env.close()
    return done


# ---- end of the NeMo Curator copy -------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path) -> Iterator[LmdbCompletionStore]:
    with LmdbCompletionStore(data_dir) as completion_store:
        yield completion_store


def checkpoint_path(data_dir: Path, name: str) -> Path:
    """What a user passes to NeMo Curator as ``checkpoint_path`` after ``tally export``."""
    return data_dir / "checkpoints" / name


def raw_entries(path: Path) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """(names in the main database, (key, value) pairs of completed_sources) of one file."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        with env.begin() as txn:
            names = [key for key, _ in txn.cursor()]
        db = env.open_db(_COMPLETED_DB)
        with env.begin(db=db) as txn:
            pairs = list(txn.cursor(db=db))
        return names, pairs
    finally:
        env.close()


def test_tally_files_are_read_by_nemo_curator(store: LmdbCompletionStore, data_dir: Path) -> None:
    ids = ["3f2a9c0e", "hash/with/slashes", "ünïcødé-✓", "x" * 511]
    store.commit(
        [
            PutCompleted("curation/run-42", "node1-1234", ids[:2]),
            PutCompleted("curation/run-42", "node2-5678", ids[2:]),
            PutCompleted("curation/run-42", "node2-5678", ["to-be-removed"]),
        ]
    )
    store.commit([DeleteCompleted("curation/run-42", ["to-be-removed"])])
    tally_view = store.load("curation/run-42").completed
    store.close()

    base = checkpoint_path(data_dir, "curation/run-42")
    assert nemo_load_completed(base) == set(ids) == tally_view
    folder = base / METADATA_DIRNAME
    assert sorted(p.name for p in folder.iterdir()) == ["node1-1234.mdb", "node2-5678.mdb"]
    for path in folder.iterdir():
        names, pairs = raw_entries(path)
        assert names == [b"completed_sources"]
        assert pairs
        assert all(value == b"1" for _, value in pairs)
    _, pairs = raw_entries(folder / "node2-5678.mdb")
    assert [key for key, _ in pairs] == sorted(sid.encode() for sid in ids[2:])


def test_nemo_curator_folders_are_loaded_by_tally(data_dir: Path) -> None:
    base = checkpoint_path(data_dir, "imported")
    first = NemoWriter(base, "hostA-100")
    first.persist_completed(["s1", "s2", "s3"])
    first.remove_from_completed("s2")  # NeMo's un-complete of an anomaly
    first.close()
    second = NemoWriter(base, "hostB-200")
    second.persist_completed(["s3", "s4"])
    second.close()
    NemoWriter(base, "hostC-300").close()  # a run that completed nothing
    expected = nemo_load_completed(base)
    assert expected == {"s1", "s3", "s4"}

    with LmdbCompletionStore(data_dir) as store:
        loaded = store.load("imported")

    assert loaded.completed == expected
    assert loaded.unreadable == []
    assert len(loaded.files) == 3


def test_tally_writes_into_a_nemo_curator_folder_that_nemo_curator_resumes(data_dir: Path) -> None:
    base = checkpoint_path(data_dir, "shared")
    nemo = NemoWriter(base, "hostA-100")
    nemo.persist_completed(["s1", "s2"])
    nemo.close()

    with LmdbCompletionStore(data_dir) as store:
        # Tally's writer adds s3; an anomaly un-completes s1, which only NeMo's file holds.
        store.commit([PutCompleted("shared", "tally-writer", ["s3"]), DeleteCompleted("shared", ["s1"])])

    assert nemo_load_completed(base) == {"s2", "s3"}
    # And NeMo Curator can keep writing its own file after Tally touched it.
    nemo = NemoWriter(base, "hostA-100")
    nemo.persist_completed(["s5"])
    nemo.close()
    assert nemo_load_completed(base) == {"s2", "s3", "s5"}
