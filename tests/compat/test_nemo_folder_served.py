"""A folder NeMo Curator wrote is served by Tally as is; an unreadable file is surfaced, never counted."""

from __future__ import annotations

from pathlib import Path

import lmdb

import tally
from tally_server.testing import running_server
from tests.integration.workload import nemo_read, tree


def nemo_write(checkpoint_dir: Path, writer_id: str, sources: list[str]) -> None:
    """Write completions exactly as NeMo Curator 1.4.0's ResumabilityActor does."""
    folder = checkpoint_dir / ".nemo_curator_metadata"
    folder.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(
        str(folder / f"{writer_id}.mdb"),
        subdir=False,
        lock=False,
        max_dbs=1,
        map_size=1 << 30,
        metasync=False,
        sync=True,
        readahead=False,
    )
    db = env.open_db(b"completed_sources")
    with env.begin(write=True) as txn:
        for sid in sources:
            txn.put(sid.encode(), b"1", db=db, overwrite=True)
    env.close()


def test_nemo_written_folder_is_served_and_extended(tmp_path: Path) -> None:
    data = tmp_path / "data"
    folder = data / "checkpoints" / "nemo" / "run"
    nemo_write(folder, "gpu-node-1-4242", ["a", "b"])
    nemo_write(folder, "gpu-node-2-77", ["c"])
    (folder / ".nemo_curator_metadata" / "gpu-node-3-9.mdb").write_bytes(b"not an lmdb file" * 512)
    with running_server(data, settle_ms=0) as server, tally.Client(server.grpc_address) as client:
        assert client.are_completed("nemo/run", ["a", "b", "c", "d"]) == [True, True, True, False]
        status = client.checkpoint("nemo/run")
        assert (status.completed_count, status.unreadable_files) == (3, 1)
        with client.writer("nemo/run", writer_id="tally-host-1") as w:
            w.apply_deltas(tree("d"))
        assert client.are_completed("nemo/run", ["d"]) == [True]
    assert "unreadable_file" in (data / "tally-serve.log").read_text()
    # NeMo Curator, reading the folder back, sees its own files and Tally's and skips the bad one.
    assert nemo_read(folder) == {"a", "b", "c", "d"}
