"""Damaged files, links and quarantine in LmdbCompletionStore, on real files (issue #7: 2, 7, 8, 9)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import lmdb
import pytest

from tally_server.domain.ports import DeleteCompleted, PutCompleted, QuarantinedFile
from tally_server.store.lmdb_files import LmdbCompletionStore
from tests import lmdb_damage

NemoWrite = Callable[[Path, Iterable[str]], None]
ReadFile = Callable[[Path], set[str]]

GARBAGE = b"this is not an LMDB file\n" * 1000
MANY = [f"source-{i:05d}" for i in range(3000)]


def folder_of(data_dir: Path, checkpoint: str) -> Path:
    return data_dir / "checkpoints" / checkpoint / ".nemo_curator_metadata"


def snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder next to (not inside) the data directory."""
    folder = tmp_path / "outside"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------- reading (point 2)


@pytest.mark.parametrize(
    ("where", "reported"),
    [
        ("main_root", "MDB_CORRUPTED: Located page was wrong type"),  # LMDB's open_db finds it
        # Found in the pages before any cursor walk (on a leaf, LMDB's walk would abort the process).
        ("tree_root", "DamagedFileError: damaged LMDB tree in completed_sources: branch"),
        ("leaf", "DamagedFileError: damaged LMDB tree in completed_sources: leaf page"),
    ],
)
def test_a_damaged_file_lmdb_still_opens_is_unreadable_never_empty(
    store: LmdbCompletionStore,
    data_dir: Path,
    nemo_write: NemoWrite,
    where: lmdb_damage.Damage,
    reported: str,
) -> None:
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "good", ["a"])])
    nemo_write(folder / "big.mdb", MANY)
    lmdb_damage.damage(folder / "big.mdb", where)

    loaded = store.load("run")

    assert loaded.completed == {"a"}
    (bad,) = loaded.unreadable
    assert bad.path == str(folder / "big.mdb")
    assert reported in bad.error


def test_only_a_missing_database_reads_as_empty(store: LmdbCompletionStore, data_dir: Path) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    lmdb.open(str(folder / "bare.mdb"), subdir=False, lock=False, max_dbs=1).close()
    # "completed_sources" as a plain key of the main database, not a database: not NeMo's format.
    env = lmdb.open(str(folder / "plain.mdb"), subdir=False, lock=False, max_dbs=1)
    with env.begin(write=True) as txn:
        txn.put(b"completed_sources", b"1")
    env.close()

    loaded = store.load("run")

    assert loaded.completed == set()  # bare.mdb reads as empty, not as unreadable
    assert [(Path(u.path).name, "MDB_INCOMPATIBLE" in u.error) for u in loaded.unreadable] == [
        ("plain.mdb", True)
    ]


# ---------------------------------------------------------------- links (point 9)


def test_a_link_to_an_outside_file_is_unreadable_and_never_read(
    store: LmdbCompletionStore, data_dir: Path, outside: Path, nemo_write: NemoWrite
) -> None:
    target = outside / "secret.mdb"
    nemo_write(target, ["outside-1", "outside-2"])
    before = snapshot(target)
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "good", ["a"])])
    (folder / "other.mdb").symlink_to(target)
    (folder / "folder.mdb").mkdir()

    loaded = store.load("run")

    assert loaded.completed == {"a"}
    unreadable = {Path(u.path).name: u.error for u in loaded.unreadable}
    assert sorted(unreadable) == ["folder.mdb", "other.mdb"]
    assert "symbolic link" in unreadable["other.mdb"] and "directory" in unreadable["folder.mdb"]
    # An un-complete reaches every file of the checkpoint, but never through a link.
    store.commit([DeleteCompleted("run", ["outside-1", "a"])])
    assert snapshot(target) == before
    assert store.load("run").completed == set()


def test_a_dangling_link_as_own_file_creates_nothing_outside(
    store: LmdbCompletionStore, data_dir: Path, outside: Path, read_file: ReadFile
) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    (folder / "w1.mdb").symlink_to(outside / "created-through.mdb")

    report = store.commit([PutCompleted("run", "w1", ["a"])])

    assert list(outside.iterdir()) == []
    (q,) = report.quarantined
    moved = Path(q.moved_to)
    assert moved.is_symlink() and os.readlink(moved) == str(outside / "created-through.mdb")
    assert "symbolic link" in q.error
    assert not (folder / "w1.mdb").is_symlink()
    assert store.load("run").completed == {"a"}
    store.close()
    assert read_file(folder / "w1.mdb") == {"a"}


def test_a_link_to_an_outside_lmdb_file_is_never_written(
    store: LmdbCompletionStore, data_dir: Path, outside: Path, nemo_write: NemoWrite
) -> None:
    target = outside / "victim.mdb"
    nemo_write(target, ["theirs"])
    before = snapshot(target)
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    (folder / "w1.mdb").symlink_to(target)

    report = store.commit([PutCompleted("run", "w1", ["a"])])

    assert snapshot(target) == before
    assert [Path(q.path).name for q in report.quarantined] == ["w1.mdb"]
    assert store.load("run").completed == {"a"}  # "theirs" was never counted


# ---------------------------------------------------------------- quarantine (points 7, 8)


def _garbage(path: Path, nemo_write: NemoWrite) -> None:
    path.write_bytes(GARBAGE)


def _truncated(path: Path, nemo_write: NemoWrite) -> None:
    nemo_write(path, MANY)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])


def _one_meta_page(path: Path, nemo_write: NemoWrite) -> None:
    # What a full disk left behind while the file was created in place (issue #7, point 7).
    nemo_write(path, [])
    path.write_bytes(path.read_bytes()[:4096])


def _empty(path: Path, nemo_write: NemoWrite) -> None:
    path.write_bytes(b"")


def _main_root(path: Path, nemo_write: NemoWrite) -> None:
    nemo_write(path, MANY)
    lmdb_damage.damage(path, "main_root")


def _tree_root(path: Path, nemo_write: NemoWrite) -> None:
    nemo_write(path, MANY)
    lmdb_damage.damage(path, "tree_root")


def _leaf(path: Path, nemo_write: NemoWrite) -> None:
    nemo_write(path, MANY)
    lmdb_damage.damage(path, "leaf")  # a cursor walk of every id would abort the process here


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (_garbage, "MDB_INVALID"),
        (_truncated, "truncated"),
        (_one_meta_page, "MDB_INVALID"),
        (_empty, "empty file"),
        (_main_root, "MDB_CORRUPTED"),
        (_tree_root, "DamagedFileError: damaged LMDB tree"),
        (_leaf, "DamagedFileError: damaged LMDB tree"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:] or None,
)
def test_a_damaged_own_file_is_quarantined_and_the_commit_continues(
    store: LmdbCompletionStore,
    data_dir: Path,
    nemo_write: NemoWrite,
    read_file: ReadFile,
    make: Callable[[Path, NemoWrite], None],
    error: str,
) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    own = folder / "w1.mdb"
    make(own, nemo_write)
    damaged = own.read_bytes()

    report = store.commit([PutCompleted("run", "w1", ["a"]), PutCompleted("run", "w2", ["b"])])

    (q,) = report.quarantined
    assert (q.checkpoint, q.writer_id, q.path) == ("run", "w1", str(own))
    assert error in q.error
    moved = Path(q.moved_to)
    assert moved.parent.parent == data_dir.resolve() / ".trash" / "run"
    assert moved.parent.name.startswith("quarantine-") and moved.name == "w1.mdb"
    assert moved.read_bytes() == damaged  # moved aside untouched, never deleted
    assert store.load("run").completed == {"a", "b"}
    # The next commit writes into the fresh file: nothing more to quarantine.
    assert store.commit([PutCompleted("run", "w1", ["c"])]).quarantined == []
    store.close()
    assert read_file(own) == {"a", "c"}
    assert sorted(p.name for p in folder.iterdir()) == ["w1.mdb", "w2.mdb"]


def test_a_file_damaged_under_an_open_handle_is_quarantined_on_the_next_write(
    data_dir: Path, read_file: ReadFile
) -> None:
    folder = folder_of(data_dir, "run")
    with LmdbCompletionStore(data_dir) as store:
        store.commit([PutCompleted("run", "w1", MANY)])
        store.release("run")  # as after an eviction of the handle
        lmdb_damage.damage(folder / "w1.mdb", "main_root")

        report = store.commit([PutCompleted("run", "w1", ["late"])])

        assert [q.writer_id for q in report.quarantined] == ["w1"]
    assert read_file(folder / "w1.mdb") == {"late"}


@pytest.mark.parametrize("where", ["main_root", "leaf"])
def test_other_writers_damaged_files_are_never_quarantined(
    store: LmdbCompletionStore, data_dir: Path, nemo_write: NemoWrite, where: lmdb_damage.Damage
) -> None:
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "w1", ["a"])])
    nemo_write(folder / "w2.mdb", MANY)
    lmdb_damage.damage(folder / "w2.mdb", where)  # the delete opens w2 to remove "a": never walked
    before = snapshot(folder / "w2.mdb")

    report = store.commit([PutCompleted("run", "w1", ["b"]), DeleteCompleted("run", ["a"])])

    assert report.quarantined == []
    assert snapshot(folder / "w2.mdb") == before
    assert store.load("run").completed == {"b"}


# ---------------------------------------------------------------- atomic creation (point 7)


def test_a_new_writer_file_appears_whole_and_leaves_no_temporary_file(
    store: LmdbCompletionStore, data_dir: Path, read_file: ReadFile
) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    # Left by a coordinator killed while creating w1's file: never a *.mdb, so never loaded.
    stale = folder / ".w1.mdb.tmp-coordinator"
    stale.write_bytes(b"half")
    assert store.load("run").unreadable == []

    report = store.commit([PutCompleted("run", "w1", ["a"])])

    assert report.quarantined == []
    assert sorted(p.name for p in folder.iterdir()) == ["w1.mdb"]
    store.close()
    assert read_file(folder / "w1.mdb") == {"a"}
    env = lmdb.open(str(folder / "w1.mdb"), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        # txn 1 created the named database (as NeMo Curator's writer does on open), txn 2 the put
        assert env.info()["last_txnid"] == 2
    finally:
        env.close()


def test_quarantined_files_are_reported_per_writer(store: LmdbCompletionStore, data_dir: Path) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    for name in ("w1", "w2"):
        (folder / f"{name}.mdb").write_bytes(GARBAGE)

    report = store.commit([PutCompleted("run", "w1", ["a"]), PutCompleted("run", "w2", ["b"])])

    assert [(q.writer_id, Path(q.path).name) for q in report.quarantined] == [
        ("w1", "w1.mdb"),
        ("w2", "w2.mdb"),
    ]
    assert all(isinstance(q, QuarantinedFile) and Path(q.moved_to).is_file() for q in report.quarantined)
