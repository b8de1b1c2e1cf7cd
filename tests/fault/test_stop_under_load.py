"""Stopping the coordinator while writers are busy: every completion a flush() acknowledged is on disk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import tally
from tally_server.testing import running_server
from tests.integration.workload import nemo_read, tree

WRITERS = 3
PER_FLUSH = 40


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_stop_under_load_loses_no_acknowledged_completion(tmp_path: Path, stop: str) -> None:
    """SIGTERM must exit 0 having flushed; even SIGKILL loses nothing a flush() acknowledged."""
    data = tmp_path / "data"
    acknowledged: set[str] = set()
    lock = threading.Lock()
    rounds = threading.Semaphore(0)
    errors: list[BaseException] = []

    with running_server(data, settle_ms=0) as server:

        def work(i: int) -> None:
            client = tally.Client(server.grpc_address, timeout=5)
            writer = client.writer("fault/sigterm", writer_id=f"w{i}")
            writer.open()
            n = 0
            try:
                while n < 100_000:
                    sources = [f"w{i}-s{n + k}" for k in range(PER_FLUSH)]
                    for sid in sources:
                        writer.apply_deltas(tree(sid))
                    writer.flush(timeout=10)
                    with lock:
                        acknowledged.update(sources)
                    rounds.release()
                    n += PER_FLUSH
            except tally.TallyError:
                pass  # the coordinator went away: expected
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            finally:
                try:
                    writer.close(timeout=5)
                except tally.TallyError:
                    pass  # nobody left to close it with; the restarted coordinator records it lost
                client.close()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(WRITERS)]
        for t in threads:
            t.start()
        for _ in range(WRITERS * 3):  # every writer is in its stride
            assert rounds.acquire(timeout=60)
        if stop == "sigterm":
            assert server.terminate() == 0
        else:
            assert server.kill() == -9
        for t in threads:
            t.join(60)
            assert not t.is_alive()
    assert not errors
    on_disk = nemo_read(data / "checkpoints" / "fault" / "sigterm")
    assert len(acknowledged) >= WRITERS * 3 * PER_FLUSH
    assert acknowledged <= on_disk
