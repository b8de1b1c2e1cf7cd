"""Damaged, foreign and linked completion files under a real ``tally serve`` (issue #7: 2, 8, 9)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import tally
from tally_server.testing import running_server
from tests import lmdb_damage
from tests.integration.workload import tree
from tests.nemo_format import nemo_write

MANY = [f"source-{i:05d}" for i in range(3000)]


def folder_of(data_dir: Path, checkpoint: str) -> Path:
    return data_dir / "checkpoints" / checkpoint / ".nemo_curator_metadata"


def test_3000_completions_in_a_damaged_file_are_surfaced_not_silently_dropped(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    folder = folder_of(data_dir, "curation/run")
    nemo_write(folder / "host-1.mdb", ["a"])
    nemo_write(folder / "host-2.mdb", MANY)
    # LMDB still opens it; only the main database's root page is garbled (NeMo Curator reads 0 here).
    lmdb_damage.damage(folder / "host-2.mdb", "main_root")

    with running_server(data_dir, settle_ms=0) as server:
        status = httpx.get(f"{server.http_url}/v1/checkpoints/curation/run").json()
        events = httpx.get(f"{server.http_url}/v1/events", params={"checkpoint": "curation/run"}).json()

    assert status["unreadable_files"] == 1
    assert status["completed_count"] == 1
    (event,) = [e for e in events["events"] if e["kind"] == "unreadable_file"]
    assert event["data"]["path"] == str((folder / "host-2.mdb").resolve())
    assert "MDB_CORRUPTED" in event["data"]["error"]


@pytest.mark.parametrize("kind", ["main_root", "leaf"])
def test_a_writer_whose_own_file_is_damaged_completes_into_a_fresh_file(tmp_path: Path, kind: str) -> None:
    """Opening its own file for writing reads every id first; that must not walk a damaged leaf."""
    data_dir = tmp_path / "data"
    own = folder_of(data_dir, "run") / "w1.mdb"
    nemo_write(own, MANY)
    lmdb_damage.damage(own, kind)
    damaged = own.read_bytes()

    with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        assert client.are_completed("run", [MANY[-1]]) == [False]
        with client.writer("run", writer_id="w1") as w:
            w.apply_deltas(tree("x"))
            w.flush()
            assert w.are_completed(["x"]) == [True]

    (moved,) = (data_dir / ".trash" / "run").glob("quarantine-*/w1.mdb")
    assert moved.read_bytes() == damaged
    with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        assert client.are_completed("run", ["x", MANY[0], MANY[-1]]) == [True, False, False]
        assert client.checkpoint("run").unreadable_files == 0
