"""A full disk under a running coordinator (issue 7, points 8, 10 and 11).

The data directory sits on a small tmpfs the test mounts (root only), filled with a file of the
test's own: the real ENOSPC, in LMDB and in SQLite alike.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tally
from tally_server.testing import running_server
from tests.integration.workload import nemo_read, tree
from tests.polling import wait_until
from tests.small_disk import small_tmpfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "8m") as disk:
        yield disk


def fill(disk: Path) -> Path:
    """Write a filler file until the disk is full; returns it (delete it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exposed")


def test_a_full_disk_loses_nothing_says_so_and_recovers_by_itself(small_disk: Path) -> None:
    data = small_disk / "data"
    with (
        running_server(data, settle_ms=0, lease_ttl_s=60) as server,
        tally.Client(server.grpc_address, timeout=5) as client,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
        client.writer("disk/full", writer_id="w") as writer,
    ):
        before = [f"a{i}" for i in range(50)]
        for sid in before:
            writer.apply_deltas(tree(sid))
        writer.flush()  # acknowledged: must survive whatever follows

        filler = fill(small_disk)
        after = [f"b{i}" for i in range(50)]
        for sid in after:
            writer.apply_deltas(tree(sid))
        with pytest.raises(tally.Unavailable):
            writer.flush(timeout=3)  # never acknowledged while nothing can be written

        # Point 10: readiness and metrics say that completions cannot be persisted.
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert "completions cannot be persisted" in ready.json()["error"]["message"]
        assert metric(http, "tally_store_commit_failures_total") > 0
        assert metric(http, "tally_ready") == 0
        # Point 11: a refusal caused by the disk is UNAVAILABLE (the SDK retries it) and says why.
        refused = http.post("/v1/writers", json={"checkpoint": "disk/other", "writer_id": "x"})
        assert refused.status_code == 503, refused.text
        assert "full" in refused.json()["error"]["message"]
        assert client.are_completed("disk/full", before + after) == [True] * 50 + [False] * 50

        filler.unlink()  # space returns
        wait_until(lambda: http.get("/readyz").status_code == 200, timeout=30, what="ready again")
        writer.flush(timeout=30)
        assert client.are_completed("disk/full", before + after) == [True] * 100

    # Point 8: commits were retried every few milliseconds while the disk was full, yet each
    # cause was logged once, not once per retry, and without a traceback: the line says it all.
    log = server.log()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) <= 6, "\n".join(errors)
    assert "Traceback" not in log, log[-4000:]
    assert any("is full; free space or grow the volume" in line for line in errors), errors
    # (The journal shares the full disk, so it is what fails first; the completion files after it.)
    retried = re.findall(
        r"(?:writing the writers' journal|committing completions) works again after (\d+) failures?", log
    )
    assert retried and max(map(int, retried)) >= 10, log[-4000:]
    assert nemo_read(data / "checkpoints" / "disk" / "full") == set(before + after)
