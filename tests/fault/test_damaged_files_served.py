"""Damaged, foreign and linked completion files under a real ``tally serve`` (issue #7: 2, 8, 9)."""

from __future__ import annotations

from pathlib import Path

import httpx

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


def test_a_writer_whose_own_file_is_damaged_completes_into_a_fresh_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    own = folder_of(data_dir, "run") / "w1.mdb"
    nemo_write(own, MANY)
    lmdb_damage.damage(own, "main_root")
    damaged = own.read_bytes()

    with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        with client.writer("run", writer_id="w1") as w:
            w.apply_deltas(tree("x"))
            w.flush()
            assert w.are_completed(["x"]) == [True]

    (moved,) = (data_dir / ".trash" / "run").glob("quarantine-*/w1.mdb")
    assert moved.read_bytes() == damaged
    # Durable in the fresh file: a new coordinator reads it back.
    with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        assert client.are_completed("run", ["x", MANY[0]]) == [True, False]
        assert client.checkpoint("run").unreadable_files == 0


def test_a_dangling_link_as_a_writer_file_creates_nothing_outside(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = folder_of(data_dir, "run")
    folder.mkdir(parents=True)
    (folder / "w1.mdb").symlink_to(outside / "planted.mdb")

    with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        assert client.checkpoint("run").unreadable_files == 1  # the link itself, never followed
        with client.writer("run", writer_id="w1") as w:
            w.apply_deltas(tree("x"))
            w.flush()
        assert client.are_completed("run", ["x"]) == [True]

    assert list(outside.iterdir()) == []
    assert not (folder / "w1.mdb").is_symlink() and (folder / "w1.mdb").is_file()


def test_a_leaf_page_of_the_wrong_type_is_reported_unreadable_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    """A leaf page with its type zeroed: LMDB's cursor walk asserts and aborts the process there.

    The load must find it in the pages instead, report the file unreadable as any other damaged
    file, never walk it, and come up again the same way after a restart (no crash loop).
    """
    data_dir = tmp_path / "data"
    folder = folder_of(data_dir, "curation/run")
    healthy = [f"healthy-{i:05d}" for i in range(3000)]
    nemo_write(folder / "host-1.mdb", healthy)
    nemo_write(folder / "host-2.mdb", MANY)
    lmdb_damage.damage(folder / "host-2.mdb", "leaf")
    damaged = (folder / "host-2.mdb").read_bytes()
    probe = MANY[::97] + [MANY[-1]]  # the last ids lie on the damaged leaf
    expected = [False] * len(probe) + [True] * 50

    for run in range(2):  # a restart serves the same answers
        with running_server(data_dir, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
            assert client.are_completed("curation/run", probe + healthy[::60]) == expected
            status = httpx.get(f"{server.http_url}/v1/checkpoints/curation/run").json()
            events = httpx.get(f"{server.http_url}/v1/events", params={"checkpoint": "curation/run"}).json()
            metrics = httpx.get(f"{server.http_url}/metrics").text
            listed = httpx.get(
                f"{server.http_url}/v1/completed", params={"checkpoint": "curation/run", "limit": 10_000}
            ).json()
            assert client.are_completed("curation/run", [MANY[-1], healthy[-1]]) == [False, True]

        assert status["unreadable_files"] == 1
        assert status["completed_count"] == len(healthy)
        reported = [e for e in events["events"] if e["kind"] == "unreadable_file"]
        assert len(reported) == run + 1  # once per load; events outlive a restart
        event = reported[-1]
        assert event["data"]["path"] == str((folder / "host-2.mdb").resolve())
        assert event["data"]["error"].startswith("DamagedFileError: damaged LMDB tree")
        assert "leaf page" in event["data"]["error"] and "type flags 0x0000" in event["data"]["error"]
        assert 'tally_unreadable_files{checkpoint="curation/run"} 1.0' in metrics
        assert listed["source_ids"] == healthy
    assert (folder / "host-2.mdb").read_bytes() == damaged  # reported, never rewritten


def test_a_writer_whose_own_file_has_a_damaged_leaf_completes_into_a_fresh_file(tmp_path: Path) -> None:
    """Opening its own file for writing reads every id first; that must not walk the damaged leaf."""
    data_dir = tmp_path / "data"
    own = folder_of(data_dir, "run") / "w1.mdb"
    nemo_write(own, MANY)
    lmdb_damage.damage(own, "leaf")
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
