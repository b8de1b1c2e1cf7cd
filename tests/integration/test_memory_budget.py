"""Idle checkpoints leave memory under the budget and come back on demand; status never loads them
(issue 7, points 6 and 13)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import tally
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree
from tests.polling import wait_until

BUDGET_MB = 1
# About 0.7 MB each once in the compact index (~9 B/id; a checkpoint no writer has open merges
# its new ids into it): one fits in the budget, two do not.
IDS = 80_000
NAMES = ("mem/a", "mem/b", "mem/c")
ENV = {"TALLY_CHECKPOINT_MEMORY_MB": str(BUDGET_MB), "TALLY_PROGRESS_INTERVAL_S": "0.2"}


def loaded_bytes(http: httpx.Client) -> dict[str, float]:
    found = {}
    for line in http.get("/metrics").text.splitlines():
        match = re.fullmatch(r'tally_checkpoint_loaded_bytes\{checkpoint="([^"]+)"\} (\S+)', line)
        if match:
            found[match[1]] = float(match[2])
    return found


def ids(name: str) -> list[str]:
    return [f"{name}-source-{i:06d}" for i in range(IDS)]


def counts(client: tally.Client) -> dict[str, int]:
    return {c.name: c.completed_count for c in client.checkpoints()}


def test_idle_checkpoints_are_unloaded_under_the_budget_and_reload_on_demand(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with (
        running_server(data, settle_ms=0, env=ENV) as server,
        tally.Client(server.grpc_address) as client,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
    ):
        for name in NAMES:
            assert client.import_completed(name, ids(name), import_id="import").imported == IDS
        wait_until(
            lambda: sum(loaded_bytes(http).values()) <= BUDGET_MB << 20,
            timeout=30,
            what="idle checkpoints unloaded down to the budget",
        )
        assert sum(1 for size in loaded_bytes(http).values() if size) <= 1
        # Status and listings answer from memory without loading anything back.
        assert counts(client) == dict.fromkeys(NAMES, IDS)
        unloaded = [name for name, size in loaded_bytes(http).items() if size == 0]
        assert len(unloaded) >= 2
        for name in unloaded:
            assert client.checkpoint(name).completed_count == IDS
        assert all(loaded_bytes(http)[name] == 0 for name in unloaded)
        # Asked about, an unloaded checkpoint loads again and answers exactly.
        for name in NAMES:
            assert client.are_completed(name, ids(name)[:3] + ["never"]) == [True, True, True, False]
        wait_until(
            lambda: sum(loaded_bytes(http).values()) <= BUDGET_MB << 20,
            timeout=30,
            what="unloaded again after use",
        )


def test_after_a_restart_status_answers_without_loading_any_checkpoint(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, env=ENV) as server, tally.Client(server.grpc_address) as client:
        for name in NAMES:
            client.import_completed(name, ids(name), import_id="import")
    with (
        running_server(data, settle_ms=0, env=ENV) as server,
        tally.Client(server.grpc_address) as client,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
    ):
        assert counts(client) == dict.fromkeys(NAMES, IDS)  # from the samples, or the census
        for _ in range(20):
            client.checkpoints()
            client.checkpoint("mem/a")
        wait_until(
            lambda: loaded_bytes(http) == dict.fromkeys(NAMES, 0.0),
            timeout=30,
            what="nothing loaded: status never loads a checkpoint",
        )


def journal_memory(http: httpx.Client) -> float:
    lines = http.get("/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith("tally_journal_memory_bytes ")))


def test_the_writers_journal_counts_against_the_budget(tmp_path: Path) -> None:
    """The journal log holds the live writers' state in memory: a checkpoint that fits in the
    budget alone is unloaded once a writer's journal takes the rest of it."""
    data = tmp_path / "data"
    with (
        running_server(data, settle_ms=0, env=ENV) as server,
        tally.Client(server.grpc_address) as client,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
    ):
        half = ids("mem/a")[: IDS // 2]
        assert client.import_completed("mem/a", half, import_id="import").imported == IDS // 2
        wait_until(  # merged into its index (no writer has it open): fits alone, with room
            lambda: 0 < loaded_bytes(http)["mem/a"] < (BUDGET_MB << 20) * 0.6,
            timeout=30,
            what="mem/a's imported ids merged into its index",
        )
        assert journal_memory(http) == 0
        writer = client.writer("mem/w", writer_id="journaled")
        writer.open()
        for chunk in range(8):  # ~5,000 sources' deltas, all pending: kept in the writer's journal
            writer.apply_deltas([d for i in range(640) for d in tree(f"s{chunk}-{i}")[:5]])
            writer.flush()
        held = journal_memory(http)
        assert held > (BUDGET_MB << 20) * 0.5, held
        wait_until(
            lambda: loaded_bytes(http)["mem/a"] == 0,
            timeout=30,
            what="mem/a unloaded: the journal's memory taken off the budget",
        )
        assert client.are_completed("mem/a", half[:2]) == [True, True]  # loads back on demand
        writer.close()


def anonymous_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for pid {pid}")


def test_a_new_checkpoint_costs_the_server_little_memory(server: RunningServer) -> None:
    """Every writer file LMDB opens for writing allocates ~3 MiB of page lists and touches a few KiB.

    glibc served those from memory it kept resident (its mmap threshold had risen past them), so each
    new checkpoint held on to megabytes: 64 of them added 123 MB. ``tally serve`` fixes the
    threshold (``tally_server.malloc``): they come from fresh mappings, 2-3 MB for all 64.
    """
    with tally.Client(server.grpc_address) as client:
        with client.writer("mem/warm", writer_id="w") as w:  # the server's first file and commits
            w.apply_deltas(tree("warm"))
        before = anonymous_bytes(server.process.pid)
        for i in range(64):
            with client.writer(f"mem/new-{i}", writer_id="w") as w:
                w.apply_deltas(tree(f"s{i}"))
        assert client.are_completed("mem/new-63", ["s63"]) == [True]
    growth = anonymous_bytes(server.process.pid) - before
    assert growth < 32 << 20, f"64 new checkpoints took {growth / 2**20:.0f} MiB of anonymous memory"


def fill(client: tally.Client, checkpoint: str, writers: int, sources: int) -> None:
    """``writers`` writers at once, each completing ``sources`` sources (4 deltas each), then closing."""

    def write(w: int) -> None:
        deltas = []
        for n in range(sources):
            sid, root = f"w{w}-s{n}", f"0_w{w}-s{n}"
            deltas += [
                (root, sid, 1),
                (f"{root}_0", sid, 1),
                (f"{root}_0_0", sid, -1),
                (f"{root}_0_1", sid, -1),
            ]
        with client.writer(checkpoint, writer_id=f"w{w}") as writer:
            for i in range(0, len(deltas), 1000):
                writer.apply_deltas(deltas[i : i + 1000])

    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))


def test_completions_written_through_the_coordinator_leave_little_memory_once_merged(
    server: RunningServer,
) -> None:
    """Once a checkpoint's last writer closes, its new ids move into the compact index (~10 B/id),
    the overlay's dict is copied down to what is left in it, and the heap the writers' sessions
    freed goes back to the system.

    Before, the ids stayed in the overlay (~112 B/id) until the next periodic merge, its dict kept
    the size of its largest moment, and the heap stayed resident: 6 checkpoints of 100,000 ids
    grew the server by 98-101 MiB; now by 46-48 (bench/README.md, "Memory per checkpoint").
    """
    sources = 50_000  # per writer, two writers per checkpoint
    with (
        tally.Client(server.grpc_address) as client,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
    ):
        fill(client, "mem/warm", 2, 10)  # the server's first sessions, commits and merge
        # Its 20 ids: ~2,300 bytes in the overlay, a few hundred in the index.
        wait_until(lambda: 0 < loaded_bytes(http)["mem/warm"] < 1000, timeout=30, what="mem/warm merged")
        before = anonymous_bytes(server.process.pid)
        for r in range(6):
            fill(client, f"mem/round-{r}", 2, sources)
            # The estimate counts an id of the overlay ~112 bytes, one of the index ~10.
            wait_until(
                lambda: 0 < loaded_bytes(http)[f"mem/round-{r}"] <= 16 * 2 * sources,  # noqa: B023
                timeout=30,
                what=f"mem/round-{r}'s ids merged into its index once its writers closed",
            )
        assert client.are_completed("mem/round-5", ["w0-s0", "w1-s49999", "w2-s0"]) == [True, True, False]
        growth = anonymous_bytes(server.process.pid) - before
    assert growth < 64 << 20, f"600,000 ids written through took {growth / 2**20:.0f} MiB of anonymous memory"
