"""The completion store on a real small filesystem that fills up or turns read-only (issue #7: 7, 8, 11).

Each test mounts its own tmpfs, so it needs root (and skips, saying so, without it). The long
disk-full campaign against a served coordinator lives in ``bench/faults.py``; these are the fast
cases of the store itself.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tally_server.domain.ports import CompletionWriteError, PutCompleted
from tally_server.store.lmdb_files import LmdbCompletionStore
from tests.nemo_format import nemo_read
from tests.small_disk import Filler, mount, small_tmpfs

SIZE_KB = 512


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A private tmpfs of SIZE_KB, unmounted afterwards."""
    with small_tmpfs(tmp_path / "volume", f"{SIZE_KB}k") as volume:
        yield volume


def folder_of(data_dir: Path, checkpoint: str) -> Path:
    return data_dir / "checkpoints" / checkpoint / ".nemo_curator_metadata"


def test_a_writer_file_created_on_a_full_disk_completes_once_space_returns(volume: Path) -> None:
    data_dir = volume / "data"
    folder = folder_of(data_dir, "run")
    filler = Filler(volume)
    with LmdbCompletionStore(data_dir) as store:
        store.commit([PutCompleted("run", "w0", ["before"])])
        filler.fill(leave=4096)  # room for one LMDB page: the new file's first meta page only

        with pytest.raises(CompletionWriteError) as failed:
            store.commit([PutCompleted("run", "w1", ["a"])])

        assert failed.value.disk_full
        message = str(failed.value)
        assert message.startswith(f"the disk holding {data_dir.resolve()} is full; free space or grow")
        assert "Tally retries by itself" in message
        # Nothing half made is left: no w1.mdb, no temporary file.
        assert sorted(p.name for p in folder.iterdir()) == ["w0.mdb"]
        assert store.load("run").unreadable == []

        filler.free()
        report = store.commit([PutCompleted("run", "w1", ["a"])])

        assert report.quarantined == []
        assert store.load("run").completed == {"before", "a"}
    assert nemo_read(folder.parent) == {"before", "a"}


def test_a_full_disk_under_an_existing_file_is_transient_never_quarantined(volume: Path) -> None:
    data_dir = volume / "data"
    filler = Filler(volume)
    with LmdbCompletionStore(data_dir) as store:
        store.commit([PutCompleted("run", "w1", ["a"])])
        filler.fill()

        big = [f"{i:0200d}" for i in range(1000)]  # ~200 KB of keys: needs new pages
        with pytest.raises(CompletionWriteError) as failed:
            store.commit([PutCompleted("run", "w1", big)])
        assert failed.value.disk_full
        assert not (data_dir / ".trash").exists()

        filler.free()
        assert store.commit([PutCompleted("run", "w1", big)]).quarantined == []
        assert store.load("run").completed == {"a", *big}


def test_a_read_only_disk_is_an_error_of_the_disk_not_of_the_file(volume: Path) -> None:
    data_dir = volume / "data"
    with LmdbCompletionStore(data_dir) as store:
        store.commit([PutCompleted("run", "w1", ["a"])])
        store.release("run")  # the next commit must open the file again
        mount("-o", "remount,ro", str(volume))
        try:
            with pytest.raises(CompletionWriteError) as failed:
                store.commit([PutCompleted("run", "w1", ["b"])])
            assert not failed.value.disk_full
            assert os.strerror(errno.EROFS) in str(failed.value)
        finally:
            mount("-o", "remount,rw", str(volume))
        assert not (data_dir / ".trash").exists()  # not quarantined: the file is fine

        assert store.commit([PutCompleted("run", "w1", ["b"])]).quarantined == []
        assert store.load("run").completed == {"a", "b"}
