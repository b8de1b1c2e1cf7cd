"""A writer's completion file is closed for writing when the writer closes (``tally serve``).

Each LMDB handle open for writing keeps its page lists (~400 KB once its writer wrote 25,000 ids),
so a server that kept every closed writer's file open (up to 256) held up to ~100 MB for nothing.
A closed writer's file must still take an anomaly's un-complete: it is opened again for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import tally
from tally_server.testing import RunningServer
from tests.integration.workload import tree
from tests.nemo_format import nemo_read_file


def open_for_writing(pid: int, folder: Path) -> set[str]:
    """The files of ``folder`` that process ``pid`` holds a descriptor on that can write."""
    found: set[str] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
            info = (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text()
        except FileNotFoundError:  # closed meanwhile
            continue
        flags = next(int(line.split()[1], 8) for line in info.splitlines() if line.startswith("flags:"))
        if target.parent == folder and flags & os.O_ACCMODE != os.O_RDONLY:
            found.add(target.name)
    return found


def test_a_closed_writers_file_is_closed_and_an_anomaly_still_reaches_it(server: RunningServer) -> None:
    name = "files/run"
    folder = (server.data_dir / "checkpoints" / name / ".nemo_curator_metadata").resolve()
    pid = server.process.pid
    with tally.Client(server.grpc_address) as client:
        a = client.writer(name, writer_id="a")
        b = client.writer(name, writer_id="b")
        a.open()
        b.open()
        a.apply_deltas(tree("s0") + tree("s1"))
        a.flush()
        b.apply_deltas(tree("t0"))
        b.flush()
        assert open_for_writing(pid, folder) == {"a.mdb", "b.mdb"}  # what this test looks at

        a.close()
        assert open_for_writing(pid, folder) == {"b.mdb"}

        # A new task for a source `a` completed: an anomaly, un-completed in a's file too.
        with client.writer(name, writer_id="c") as c:
            c.apply_deltas([("again_s0", "s0", 1)])
            c.flush()
        assert c.close().counts.anomalies == 1
        assert client.are_completed(name, ["s0", "s1", "t0"]) == [False, True, True]
        assert nemo_read_file(folder / "a.mdb") == {"s1"}
        assert "b.mdb" in open_for_writing(pid, folder)

        # The last writer's close closes every file of the checkpoint, a's opened again included.
        b.close()
        assert open_for_writing(pid, folder) == set()
        assert client.are_completed(name, ["s0", "s1", "t0"]) == [False, True, True]
