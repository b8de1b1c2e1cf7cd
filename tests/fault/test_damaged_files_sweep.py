"""Damaged completion files served by a real coordinator (bench/faults.py damaged_files).

The folder holds two valid files and six damaged ones: truncated, garbage, an LMDB file whose
main tree root has the wrong page type (MDB_CORRUPTED on open_db), one whose last leaf page has
its type zeroed (a cursor walk aborts the process), a symlink to a valid file outside the data dir
and a dangling symlink pointing outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._faultlib import damaged


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> damaged.DamagedResult:
    return damaged.measure(tmp_path_factory.mktemp("damaged"))


def test_valid_files_are_counted(result: damaged.DamagedResult) -> None:
    assert not result.good_missing


def test_every_damaged_file_is_reported_unreadable(result: damaged.DamagedResult) -> None:
    assert result.reported == set(damaged.DAMAGED)
    assert result.unreadable_count == len(damaged.DAMAGED)


def test_no_completion_is_silently_lost(result: damaged.DamagedResult) -> None:
    assert not result.silently_lost


def test_nothing_is_created_or_written_outside_the_data_dir(result: damaged.DamagedResult) -> None:
    assert result.created_outside == []
    assert result.modified_outside == []


def test_writers_whose_file_is_a_symlink_still_complete(result: damaged.DamagedResult) -> None:
    """Refusing the symlink must not refuse the writer: it continues in a file of its own."""
    assert result.writers_blocked == {}


def test_the_corruption_is_the_one_lmdb_reports_as_corrupted(tmp_path: Path) -> None:
    """The scenario's MDB_CORRUPTED file really is one: LMDB opens it, then refuses the database."""
    import lmdb

    from tests.nemo_format import nemo_write

    path = tmp_path / "c.mdb"
    nemo_write(path, ["a", "b"])
    damaged.corrupt_main_root(path)
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=1)
    try:
        with pytest.raises(lmdb.CorruptedError):
            env.open_db(b"completed_sources")
    finally:
        env.close()


def test_the_bad_leaf_aborts_a_cursor_walk(tmp_path: Path) -> None:
    """The scenario's bad leaf really is the hazard: LMDB's own walk of it kills the process."""
    import signal
    import subprocess
    import sys

    from tests import lmdb_damage
    from tests.nemo_format import nemo_write

    path = tmp_path / "leaf.mdb"
    nemo_write(path, [f"bad-leaf-{i}" for i in range(3000)])
    lmdb_damage.damage(path, "leaf")
    walk = (
        "import lmdb, sys; env = lmdb.open(sys.argv[1], subdir=False, readonly=True, lock=False, max_dbs=1); "
        "db = env.open_db(b'completed_sources'); "
        "print(sum(1 for _ in env.begin(db=db).cursor(db=db).iternext(values=False)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", walk, str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == -signal.SIGABRT, done
    assert "IS_LEAF" in done.stderr
