"""A folder NeMo Curator wrote is served by Tally as is; an unreadable file is surfaced, never counted."""

from __future__ import annotations

from pathlib import Path

import tally
from tally_server.testing import running_server
from tests.integration.workload import tree
from tests.nemo_format import METADATA_DIRNAME, nemo_read, nemo_write


def test_nemo_written_folder_is_served_and_extended(tmp_path: Path) -> None:
    data = tmp_path / "data"
    folder = data / "checkpoints" / "nemo" / "run"
    nemo_write(folder / METADATA_DIRNAME / "gpu-node-1-4242.mdb", ["a", "b"])
    nemo_write(folder / METADATA_DIRNAME / "gpu-node-2-77.mdb", ["c"])
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
