"""Byte compatibility with NeMo Curator 1.4.0's checkpoint folders, both ways (DESIGN §3).

The NeMo side is ``tests/nemo_format.py``, a copy of NeMo Curator 1.4.0's own file handling.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from tally_server.domain.ports import DeleteCompleted, PutCompleted
from tally_server.store.lmdb_files import LmdbCompletionStore
from tests.nemo_format import COMPLETED_DB, METADATA_DIRNAME, NemoWriter, nemo_read


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
        db = env.open_db(COMPLETED_DB)
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
    assert nemo_read(base) == set(ids) == tally_view
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
    expected = nemo_read(base)
    assert expected == {"s1", "s3", "s4"}

    with LmdbCompletionStore(data_dir) as store:
        loaded = store.load("imported")

    assert loaded.completed == expected
    assert loaded.unreadable == []


def test_tally_writes_into_a_nemo_curator_folder_that_nemo_curator_resumes(data_dir: Path) -> None:
    base = checkpoint_path(data_dir, "shared")
    nemo = NemoWriter(base, "hostA-100")
    nemo.persist_completed(["s1", "s2"])
    nemo.close()

    with LmdbCompletionStore(data_dir) as store:
        # Tally's writer adds s3; an anomaly un-completes s1, which only NeMo's file holds.
        store.commit([PutCompleted("shared", "tally-writer", ["s3"]), DeleteCompleted("shared", ["s1"])])

    assert nemo_read(base) == {"s2", "s3"}
    # And NeMo Curator can keep writing its own file after Tally touched it.
    nemo = NemoWriter(base, "hostA-100")
    nemo.persist_completed(["s5"])
    nemo.close()
    assert nemo_read(base) == {"s2", "s3", "s5"}


def test_applying_changes_writes_the_bytes_of_one_put_or_delete_per_key(tmp_path: Path) -> None:
    """``apply_changes`` writes runs of puts in one call: the file is byte for byte the one that one
    ``txn.put`` / ``txn.delete`` per key, in the same order (NeMo Curator's way), writes."""
    from tally.integrations import nemo_format

    keys = [f"{(i * 0x9E3779B97F4B) & ((1 << 48) - 1):012x}".encode() for i in range(6000)]
    groups: list[dict[bytes, bool]] = [
        dict.fromkeys(keys[:2500], True),
        dict.fromkeys(keys[2500:5000], True),
        # puts and deletes interleaved, some of them of keys absent or present already
        {k: i % 3 != 0 for i, k in enumerate(keys[1000:1300] + keys[5000:5400])},
        dict.fromkeys(keys[5400:], True) | dict.fromkeys(keys[:700:7], False),
    ]
    paths = [tmp_path / "by_call.mdb", tmp_path / "by_key.mdb"]
    for path in paths:
        nemo_format.create_file(path)
    env = nemo_format.open_env(paths[0], write=True)
    db = nemo_format.open_completed_db(paths[0], env)
    for changes in groups:
        nemo_format.apply_changes(env, db, changes)
    env.close()
    env = nemo_format.open_env(paths[1], write=True)
    db = nemo_format.open_completed_db(paths[1], env)
    for changes in groups:
        with env.begin(write=True) as txn:
            for key, present in changes.items():
                if present:
                    txn.put(key, b"1", db=db, overwrite=True)
                else:
                    txn.delete(key, db=db)
        env.sync(True)
    env.close()
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert len(raw_entries(paths[0])[1]) > 5000
