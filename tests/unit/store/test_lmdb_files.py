"""LmdbCompletionStore on real files: union, deletes across files, ordering, damage, paths."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tally_server.domain.ports import CompletionOp, DeleteCompleted, PutCompleted
from tally_server.store.lmdb_files import LmdbCompletionStore

# The session-scoped helpers of conftest.py (NeMo Curator's writer, a plain reader).
NemoWrite = Callable[[Path, Iterable[str]], None]
ReadFile = Callable[[Path], set[str]]

GARBAGE = b"this is not an LMDB file\n" * 1000


def folder_of(data_dir: Path, checkpoint: str) -> Path:
    return data_dir / "checkpoints" / checkpoint / ".nemo_curator_metadata"


def test_round_trip_across_writer_files(store: LmdbCompletionStore, data_dir: Path) -> None:
    store.commit(
        [
            PutCompleted("run", "host-1", ["a", "b"]),
            PutCompleted("run", "host-2", ["c"]),
            PutCompleted("run", "host-3", ["d", "e", "f"]),
        ]
    )

    loaded = store.load("run")

    assert loaded.completed == {"a", "b", "c", "d", "e", "f"}
    folder = folder_of(data_dir, "run")
    assert loaded.unreadable == []
    assert sorted(p.name for p in folder.iterdir()) == ["host-1.mdb", "host-2.mdb", "host-3.mdb"]


def test_each_writer_writes_only_its_own_file_and_load_is_the_union(
    store: LmdbCompletionStore, data_dir: Path, read_file: ReadFile
) -> None:
    store.commit([PutCompleted("run", "w1", ["a", "b"]), PutCompleted("run", "w2", ["b", "c"])])
    store.commit([PutCompleted("run", "w1", ["d"])])

    assert store.load("run").completed == {"a", "b", "c", "d"}
    store.close()
    folder = folder_of(data_dir, "run")
    assert read_file(folder / "w1.mdb") == {"a", "b", "d"}
    assert read_file(folder / "w2.mdb") == {"b", "c"}


def test_load_sees_files_added_by_others(
    store: LmdbCompletionStore, data_dir: Path, nemo_write: NemoWrite
) -> None:
    store.commit([PutCompleted("run", "tally-writer", ["a"])])
    nemo_write(folder_of(data_dir, "run") / "nemo-host-99.mdb", ["b", "c"])

    assert store.load("run").completed == {"a", "b", "c"}


def test_one_transaction_per_file_per_commit(store: LmdbCompletionStore, data_dir: Path) -> None:
    sources = [f"source-{i}" for i in range(1000)]
    store.commit([PutCompleted("run", "w1", sources[:500]), PutCompleted("run", "w1", sources[500:])])
    store.close()

    env = lmdb.open(str(folder_of(data_dir, "run") / "w1.mdb"), subdir=False, readonly=True, lock=False)
    try:
        # txn 1 created the named database (as NeMo Curator's writer does on open), txn 2 is the commit
        assert env.info()["last_txnid"] == 2
    finally:
        env.close()


def test_delete_removes_from_every_file_that_holds_the_source(
    store: LmdbCompletionStore, data_dir: Path, nemo_write: NemoWrite, read_file: ReadFile
) -> None:
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "w1", ["a", "b"]), PutCompleted("run", "w2", ["a", "c"])])
    nemo_write(folder / "foreign.mdb", ["a", "b", "d"])  # in the folder, never opened by Tally

    store.commit([DeleteCompleted("run", ["a", "b"])])

    assert store.load("run").completed == {"c", "d"}
    store.close()
    assert read_file(folder / "w1.mdb") == set()
    assert read_file(folder / "w2.mdb") == {"c"}
    assert read_file(folder / "foreign.mdb") == {"d"}


def test_delete_is_scoped_to_its_checkpoint(store: LmdbCompletionStore) -> None:
    store.commit([PutCompleted("one", "w", ["a"]), PutCompleted("two", "w", ["a"])])

    store.commit([DeleteCompleted("one", ["a"])])

    assert store.load("one").completed == set()
    assert store.load("two").completed == {"a"}


def test_delete_leaves_a_file_without_the_database_untouched(
    store: LmdbCompletionStore, data_dir: Path
) -> None:
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    lmdb.open(str(folder / "bare.mdb"), subdir=False, lock=False, max_dbs=1).close()
    before = (folder / "bare.mdb").read_bytes()

    store.commit([DeleteCompleted("run", ["a"])])

    assert (folder / "bare.mdb").read_bytes() == before
    assert (store.load("run").completed, store.load("run").unreadable) == (set(), [])  # read as empty


def test_delete_of_a_missing_checkpoint_creates_nothing(store: LmdbCompletionStore, data_dir: Path) -> None:
    store.commit([DeleteCompleted("nowhere", ["a"])])

    assert not (data_dir / "checkpoints" / "nowhere").exists()


def test_put_then_delete_in_one_commit(
    store: LmdbCompletionStore, data_dir: Path, read_file: ReadFile
) -> None:
    store.commit([PutCompleted("run", "w2", ["b", "x"])])

    store.commit(
        [
            PutCompleted("run", "w1", ["a", "keep"]),
            DeleteCompleted("run", ["a"]),  # undoes the put above
            DeleteCompleted("run", ["b"]),
            PutCompleted("run", "w1", ["b"]),  # re-adds b, to w1 only
            PutCompleted("run", "w2", ["c"]),
            DeleteCompleted("run", ["c"]),
            PutCompleted("run", "w2", ["c"]),
            DeleteCompleted("run", ["c"]),  # last word: c is gone
        ]
    )

    assert store.load("run").completed == {"keep", "b", "x"}
    store.close()
    folder = folder_of(data_dir, "run")
    assert read_file(folder / "w1.mdb") == {"keep", "b"}
    assert read_file(folder / "w2.mdb") == {"x"}


# Few writers and ids, so that ops collide on the same file and the same key often.
_writers = st.sampled_from(["w1", "w2"])
_ids = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2)
_ops = st.lists(
    st.one_of(
        st.builds(PutCompleted, st.just("run"), _writers, _ids),
        st.builds(DeleteCompleted, st.just("run"), _ids),
    ),
    max_size=8,
)


def _files_after(ops_per_commit: list[list[CompletionOp]], read_file: ReadFile) -> dict[str, set[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        with LmdbCompletionStore(Path(tmp)) as s:
            for ops in ops_per_commit:
                s.commit(ops)
        folder = folder_of(Path(tmp), "run")
        paths = sorted(folder.glob("*.mdb")) if folder.is_dir() else []
        return {p.name: read_file(p) for p in paths}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=_ops, ops=_ops)
def test_one_commit_equals_the_ops_one_after_another(
    read_file: ReadFile, setup: list[CompletionOp], ops: list[CompletionOp]
) -> None:
    batched = _files_after([setup, ops], read_file)
    sequential = _files_after([setup, *([op] for op in ops)], read_file)

    assert batched == sequential


def test_unreadable_files_are_listed_and_skipped(
    store: LmdbCompletionStore,
    data_dir: Path,
    nemo_write: NemoWrite,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "good", ["a"])])
    nemo_write(folder / "big.mdb", [f"source-{i:05d}" for i in range(5000)])
    whole = (folder / "big.mdb").read_bytes()
    (folder / "truncated.mdb").write_bytes(whole[: len(whole) // 2])  # reading it would SIGBUS
    (folder / "garbage.mdb").write_bytes(GARBAGE)
    (folder / "empty.mdb").write_bytes(b"")
    nemo_write(folder / "zz-other.mdb", ["z"])

    with caplog.at_level(logging.WARNING, logger="tally_server.store"):
        loaded = store.load("run")

    assert loaded.completed == {"a", "z"} | {f"source-{i:05d}" for i in range(5000)}
    unreadable = {Path(u.path).name: u.error for u in loaded.unreadable}
    assert sorted(unreadable) == ["empty.mdb", "garbage.mdb", "truncated.mdb"]
    assert "truncated" in unreadable["truncated.mdb"]
    assert "MDB_INVALID" in unreadable["garbage.mdb"]
    assert unreadable["empty.mdb"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    for name, error in unreadable.items():
        assert any(name in message and error in message for message in warnings)


def test_delete_skips_unreadable_files_without_touching_them(
    store: LmdbCompletionStore, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = folder_of(data_dir, "run")
    store.commit([PutCompleted("run", "w1", ["a", "b"])])
    (folder / "garbage.mdb").write_bytes(GARBAGE)

    with caplog.at_level(logging.WARNING, logger="tally_server.store"):
        store.commit([DeleteCompleted("run", ["a"])])

    assert store.load("run").completed == {"b"}
    assert (folder / "garbage.mdb").read_bytes() == GARBAGE
    assert any("garbage.mdb" in r.getMessage() for r in caplog.records)


def test_load_and_exists_of_a_missing_checkpoint_create_nothing(
    store: LmdbCompletionStore, data_dir: Path
) -> None:
    loaded = store.load("curation/run-42")

    assert (loaded.completed, loaded.unreadable) == (set(), [])
    assert store.exists("curation/run-42") is False
    assert not data_dir.exists()


def test_exists_after_the_first_put(store: LmdbCompletionStore) -> None:
    store.commit([PutCompleted("run", "w1", [])])  # creates the writer's (empty) file

    assert store.exists("run")
    assert store.load("run").completed == set()
    assert store.load("run").unreadable == []


def test_nested_checkpoint_names(store: LmdbCompletionStore, data_dir: Path) -> None:
    store.commit([PutCompleted("a/b", "w", ["inner"])])

    assert (data_dir / "checkpoints" / "a" / "b" / ".nemo_curator_metadata" / "w.mdb").is_file()
    assert store.exists("a/b")
    assert not store.exists("a")  # a's folder exists only as the parent of a/b
    assert store.load("a").completed == set()

    store.commit([PutCompleted("a", "w", ["outer"])])

    assert store.load("a").completed == {"outer"}
    assert store.load("a/b").completed == {"inner"}
    store.commit([DeleteCompleted("a", ["inner", "outer"])])
    assert store.load("a/b").completed == {"inner"}


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "/etc", "..", ".", "a/.."])
def test_checkpoint_names_that_escape_are_refused(
    store: LmdbCompletionStore, tmp_path: Path, name: str
) -> None:
    with pytest.raises(ValueError, match="outside"):
        store.load(name)
    with pytest.raises(ValueError, match="outside"):
        store.exists(name)
    with pytest.raises(ValueError, match="outside"):
        store.commit([PutCompleted(name, "w", ["a"])])
    with pytest.raises(ValueError, match="outside"):
        store.commit([DeleteCompleted(name, ["a"])])

    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_symlink_out_of_the_data_directory_is_refused(
    store: LmdbCompletionStore, data_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (data_dir / "checkpoints").mkdir(parents=True)
    (data_dir / "checkpoints" / "link").symlink_to(outside)

    with pytest.raises(ValueError, match="outside"):
        store.commit([PutCompleted("link", "w", ["a"])])
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("writer_id", ["../w", "a/b", "..", ""])
def test_writer_ids_that_escape_are_refused(
    store: LmdbCompletionStore, data_dir: Path, writer_id: str
) -> None:
    with pytest.raises(ValueError, match="writer_id"):
        store.commit([PutCompleted("run", "ok", ["a"]), PutCompleted("run", writer_id, ["a"])])

    assert not data_dir.exists()  # refused before anything was written


def test_oversize_source_id_is_refused_before_writing(store: LmdbCompletionStore, data_dir: Path) -> None:
    with pytest.raises(ValueError, match="511"):
        store.commit([PutCompleted("run", "w", ["ok"]), PutCompleted("run", "w", ["x" * 512])])

    assert not data_dir.exists()


def test_a_full_map_grows(data_dir: Path) -> None:
    sources = {f"{i:064d}" for i in range(3000)}  # far more than 64 KiB of keys
    with LmdbCompletionStore(data_dir, map_size=64 * 1024) as small:
        small.commit([PutCompleted("run", "w", ["first"])])
        assert small.load("run").completed == {"first"}
        small.commit([PutCompleted("run", "w", sorted(sources))])
        assert small.load("run").completed == sources | {"first"}


def test_open_handles_are_bounded(data_dir: Path, read_file: ReadFile) -> None:
    with LmdbCompletionStore(data_dir, max_open_files=2) as s:
        for round_ in range(3):
            s.commit([PutCompleted("run", f"w{n}", [f"{round_}-{n}"]) for n in range(5)])
            assert len(s._handles) <= 2
        s.commit([DeleteCompleted("run", ["1-0", "1-4"])])
        assert len(s._handles) <= 2
        expected = {f"{r}-{n}" for r in range(3) for n in range(5)} - {"1-0", "1-4"}
        assert s.load("run").completed == expected

    folder = folder_of(data_dir, "run")
    assert read_file(folder / "w0.mdb") == {"0-0", "2-0"}
    assert read_file(folder / "w2.mdb") == {"0-2", "1-2", "2-2"}


def test_release_and_reopen(store: LmdbCompletionStore, data_dir: Path) -> None:
    store.commit([PutCompleted("run", "w", ["a"])])
    store.release("run")
    moved = data_dir / "trash" / "run"
    moved.parent.mkdir()
    (data_dir / "checkpoints" / "run").rename(moved)

    store.commit([PutCompleted("run", "w", ["b"])])

    assert store.load("run").completed == {"b"}  # nothing leaked into the moved files


def test_closed_store_refuses_calls(data_dir: Path) -> None:
    s = LmdbCompletionStore(data_dir)
    s.commit([PutCompleted("run", "w", ["a"])])
    s.close()
    s.close()

    with pytest.raises(RuntimeError, match="closed"):
        s.commit([PutCompleted("run", "w", ["b"])])
    with pytest.raises(RuntimeError, match="closed"):
        s.load("run")


def test_load_runs_concurrently_with_commit(store: LmdbCompletionStore) -> None:
    batches = [[f"{n}-{i}" for i in range(50)] for n in range(40)]
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[int] = []

    def commit_all() -> None:
        try:
            for n, batch in enumerate(batches):
                store.commit([PutCompleted("run", f"w{n % 3}", batch)])
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=commit_all)
    writer.start()
    while not done.is_set():
        loaded = store.load("run")
        assert loaded.unreadable == []
        # Batches commit in order and a file is read whole, so every load sees whole batches.
        assert len(loaded.completed) % 50 == 0
        seen.append(len(loaded.completed))
    writer.join()

    assert errors == []
    assert seen == sorted(seen)  # each load reads every file later than the one before
    assert store.load("run").completed == {sid for batch in batches for sid in batch}


def test_a_file_looked_up_after_a_restart_can_be_written_again(data_dir: Path) -> None:
    # A lookup (confirming a hash hit) opens the file read-only; a later commit to the same file
    # must not fail with LMDB's "already open in this process" (it did after a restart: the
    # restored writer's file was looked up before the writer's next completion).
    with LmdbCompletionStore(data_dir) as before:
        before.commit([PutCompleted("run", "w", ["a"])])
    with LmdbCompletionStore(data_dir) as after:  # a new process: no write handle open yet
        assert after.contains("run", "w", [b"a", b"b"]) == [True, False]
        after.commit([PutCompleted("run", "w", ["b"])])
        assert after.contains("run", "w", [b"a", b"b"]) == [True, True]
        assert after.load("run").completed == {"a", "b"}


def test_released_files_are_closed_and_written_again_on_demand(
    store: LmdbCompletionStore, data_dir: Path, read_file: ReadFile
) -> None:
    store.commit([PutCompleted("run", w, [f"{w}-a", "shared"]) for w in ("w1", "w2", "w3")])
    store.commit([PutCompleted("other", "w1", ["x"])])
    assert len(store._handles) == 4

    store.release_files("run", "w1")  # w1 closed: its file only
    assert len(store._handles) == 3
    # An anomaly un-completes a source in every file, the closed writer's too (opened again).
    store.commit([DeleteCompleted("run", ["shared"])])
    assert store.load("run").completed == {"w1-a", "w2-a", "w3-a"}

    store.release_files("run")  # the checkpoint's last writer closed: all its files
    assert len(store._handles) == 1
    folder = folder_of(data_dir, "run")
    assert read_file(folder / "w1.mdb") == {"w1-a"}  # not held: read from another handle
    store.commit([PutCompleted("run", "w1", ["w1-b"])])  # the same writer id again
    assert store.load("run").completed == {"w1-a", "w1-b", "w2-a", "w3-a"}
    store.release_files("run", "never-wrote")  # no file: nothing to do

    store.close()
    store.release_files("run")  # after the store closed: nothing to do
