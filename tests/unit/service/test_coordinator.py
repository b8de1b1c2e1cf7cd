"""The service's async plumbing with a fake clock: no real sleeps, background steps driven by hand.

Real stores (LMDB files and SQLite in a temporary directory); only time is simulated, and the
background loops never wake by themselves: each test runs their steps when it wants them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from tally_server.domain.journal import Applied
from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    CompletionWriteError,
    JournalEntry,
    JournalOp,
    PutCompleted,
)
from tally_server.domain.validation import Limits
from tally_server.errors import NotFound, Unavailable
from tally_server.service import CoordinatorService
from tally_server.service import writers as writers_module
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.registry import SqlRegistry, default_sqlite_url
from tests.integration.workload import nemo_read, tree

TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(LmdbCompletionStore):
    """The real store, counting its commits (to see group commit at work)."""

    commits = 0

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        self.commits += 1
        return super().commit(ops)


async def never(seconds: float) -> None:
    await asyncio.Event().wait()


class Harness:
    def __init__(self, service: CoordinatorService, clock: Clock, store: CountingStore) -> None:
        self.service, self.clock, self.store = service, clock, store

    async def advance(self, seconds: float, step: float = 0.1) -> None:
        """Let time pass normally: the clock loop ticks every ``step`` (no stall)."""
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.clock.now = min(end, self.clock.now + step)
            await self.step("clock")

    async def step(self, loop: str) -> None:
        await self.service.loop(loop).run_once()


def coordinator(
    tmp_path: Path, store: LmdbCompletionStore, clock: Clock, settle_ms: int
) -> CoordinatorService:
    """A coordinator on ``store`` and real LMDB journal and SQLite registry files, on a test clock."""
    return CoordinatorService(
        completions=store,
        journal=LogJournal(tmp_path),
        registry=SqlRegistry(default_sqlite_url(tmp_path)),
        limits=Limits(),
        settle_ms=settle_ms,
        lease_ttl_s=TTL,
        clock=clock,
        wall_clock=clock,
        sleep=never,
    )


def run(tmp_path: Path, scenario: Callable[[Harness], Awaitable[None]], *, settle_ms: int = 250) -> None:
    async def main() -> None:
        clock = Clock()
        store = CountingStore(tmp_path)
        service = coordinator(tmp_path, store, clock, settle_ms)
        await service.start()
        try:
            await scenario(Harness(service, clock, store))
        finally:
            await service.shutdown()

    asyncio.run(main())


async def settled(task: asyncio.Task[object]) -> bool:
    for _ in range(5):  # let the task run whatever became ready
        await asyncio.sleep(0)
    return task.done()


def test_flush_waits_for_the_settle_window_and_no_longer(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        opened = await svc.open_writer("unit/settle", writer_id="w")
        await svc.apply_deltas(opened.handle, tree("a"))
        flush = asyncio.ensure_future(svc.flush(opened.handle))
        await h.advance(0.2)
        await h.step("settle")
        assert not await settled(flush)  # 200 ms into a 250 ms window
        assert await svc.are_completed("unit/settle", ["a"]) == [False]
        await h.advance(0.1)
        await h.step("settle")
        assert await asyncio.wait_for(flush, 5) == 1
        assert await svc.are_completed("unit/settle", ["a"]) == [True]

    run(tmp_path, scenario)
    assert nemo_read(tmp_path / "checkpoints" / "unit" / "settle") == {"a"}


def test_a_delta_inside_the_window_cancels_the_settle(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        opened = await svc.open_writer("unit/cancel", writer_id="w")
        await svc.apply_deltas(opened.handle, [("t1", "a", 1), ("t2", "a", -1)])  # touches zero
        await h.advance(0.2)
        await svc.apply_deltas(opened.handle, [("t3", "a", 1)])  # the late fan-out
        await h.advance(0.2)
        await h.step("settle")
        assert await svc.are_completed("unit/cancel", ["a"]) == [False]
        assert (await svc.get_checkpoint("unit/cancel")).pending_sources == 1

    run(tmp_path, scenario)


def test_concurrent_completions_are_committed_in_groups(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        writers = [await svc.open_writer("unit/group", writer_id=f"w{i}") for i in range(20)]
        before = h.store.commits
        await asyncio.gather(*(svc.apply_deltas(w.handle, tree(f"s{i}")) for i, w in enumerate(writers)))
        assert await svc.are_completed("unit/group", [f"s{i}" for i in range(20)]) == [True] * 20
        assert h.store.commits - before < 20  # one synced transaction served several writers

    run(tmp_path, scenario, settle_ms=0)


def test_a_lease_runs_out_after_its_ttl_of_normal_time(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        quiet = await svc.open_writer("unit/lease", writer_id="quiet")
        busy = await svc.open_writer("unit/lease", writer_id="busy")
        for _ in range(3):
            await h.advance(TTL / 2)
            await svc.keep_alive(busy.handle)
            await h.step("lease")
        with pytest.raises(NotFound):
            await svc.keep_alive(quiet.handle)
        assert await svc.keep_alive(busy.handle) == TTL

    run(tmp_path, scenario)


def test_a_stall_does_not_count_against_leases(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        opened = await svc.open_writer("unit/stall", writer_id="w")
        await h.advance(TTL / 2)
        h.clock.now += 10 * TTL  # the process was stopped: one tick sees a huge gap
        await h.step("clock")
        await h.step("lease")
        assert await svc.keep_alive(opened.handle) == TTL  # still alive: it could not be heard
        await h.advance(TTL * 1.1)
        await h.step("lease")
        with pytest.raises(NotFound):
            await svc.keep_alive(opened.handle)  # but a writer that is gone still expires

    run(tmp_path, scenario)


def test_close_waits_for_a_completion_commit_already_in_flight(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        opened = await svc.open_writer("unit/close", writer_id="w")
        await svc.apply_deltas(opened.handle, tree("a"))
        await h.advance(0.3)
        await h.step("settle")  # starts the finalizing commit of "a" in the background
        closed = await svc.close_writer(opened.handle)
        assert closed.counts.completed == 1 and closed.incomplete_count == 0
        assert await svc.are_completed("unit/close", ["a"]) == [True]

    run(tmp_path, scenario)
    assert nemo_read(tmp_path / "checkpoints" / "unit" / "close") == {"a"}


def test_a_close_sent_again_gets_the_first_answer_from_memory_then_from_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers of the latest closes are kept (the sources they list included) within bounds; an
    answer dropped from memory comes from the writer's registry row (counts and how many sources
    were left incomplete). Two closes of one writer at once get the same answer."""
    monkeypatch.setattr(writers_module, "CLOSED_ANSWERS_KEPT", 2)
    monkeypatch.setattr(writers_module, "CLOSED_ANSWERS_SOURCES_KEPT", 3)

    async def scenario(h: Harness) -> None:
        svc = h.service
        handles = []
        for i in range(3):
            opened = await svc.open_writer("unit/again", writer_id=f"w{i}")
            await svc.apply_deltas(opened.handle, tree(f"a{i}") + [(f"t{i}", f"left{i}", 1)])
            handles.append(opened.handle)
        both = await asyncio.gather(svc.close_writer(handles[0]), svc.close_writer(handles[0]))
        assert both[0] == both[1]
        assert both[0].incomplete_sources == ["left0"] and both[0].counts.completed == 1
        for handle in handles[1:]:
            await svc.close_writer(handle)
        # w1 and w2 are the two answers kept; w0's was dropped: its registry row answers.
        assert (await svc.close_writer(handles[2])).incomplete_sources == ["left2"]
        again = await svc.close_writer(handles[0])
        assert again.incomplete_sources == [] and again.incomplete_count == 1
        assert again.counts == both[0].counts
        # Still NOT_FOUND: a handle never opened, and every other call of a closed writer.
        with pytest.raises(NotFound):
            await svc.close_writer("0123456789abcdef0123456789abcdef")
        with pytest.raises(NotFound):
            await svc.apply_deltas(handles[0], tree("late"))
        # The answer handed out is a copy: changing it changes no later answer.
        again.incomplete_sources.append("mine")
        assert (await svc.close_writer(handles[2])).incomplete_sources == ["left2"]

    run(tmp_path, scenario)


def test_closing_completes_every_settling_source_at_once(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        svc = h.service
        opened = await svc.open_writer("unit/closing", writer_id="w")
        await svc.apply_deltas(opened.handle, tree("a") + tree("b") + [("x", "c", 1)])
        closed = await svc.close_writer(opened.handle)  # no time passed: a and b were settling
        assert closed.counts.completed == 2
        assert closed.incomplete_sources == ["c"]
        assert await svc.are_completed("unit/closing", ["a", "b", "c"]) == [True, True, False]

    run(tmp_path, scenario)


def test_a_joint_commit_makes_a_groups_journal_and_completions_durable_together_or_not_at_all(
    tmp_path: Path,
) -> None:
    """The PostgreSQL store's way (one transaction per group), here over the LMDB stores."""
    groups: list[tuple[list[JournalOp], list[CompletionOp]]] = []
    joined: list[int] = []  # the completion ops of each joint commit that went through
    failing = False

    async def main() -> None:
        clock = Clock()
        store, journal = CountingStore(tmp_path), LogJournal(tmp_path)

        def joint(entries: Sequence[JournalOp], changes: Sequence[CompletionOp]) -> CommitReport:
            groups.append((list(entries), list(changes)))
            if failing:
                raise CompletionWriteError("the database is down", path="db", disk_full=False)
            journal.commit(entries)
            joined.append(len(changes))
            return store.commit(changes)

        service = CoordinatorService(
            completions=store,
            journal=journal,
            registry=SqlRegistry(default_sqlite_url(tmp_path)),
            limits=Limits(),
            settle_ms=0,
            lease_ttl_s=TTL,
            clock=clock,
            wall_clock=clock,
            sleep=never,
            joint_commit=joint,
        )
        await service.start()
        try:
            await scenario(Harness(service, clock, store), journal)
        finally:
            await service.shutdown()

    async def scenario(h: Harness, journal: LogJournal) -> None:
        nonlocal failing
        svc = h.service
        opened = await svc.open_writer("unit/joint", writer_id="w")
        failing = True
        with pytest.raises(Unavailable, match="could not persist completions"):
            await svc.apply_deltas(opened.handle, tree("a"), batch_seq=1)
        entries, changes = groups[-1]
        assert [type(e) for e in entries] == [JournalEntry, JournalEntry]  # Applied, Completing
        assert changes == [PutCompleted("unit/joint", "w", ["a"])]  # the same group, the same failure
        assert await svc.are_completed("unit/joint", ["a"]) == [False]
        (writer,) = journal.load()
        assert writer.entries == []  # neither is durable
        failing = False
        await h.step("settle")  # the reverted source settles again and commits
        assert await asyncio.wait_for(svc.flush(opened.handle), 5) == 1
        assert await svc.are_completed("unit/joint", ["a"]) == [True]
        (writer,) = journal.load()
        assert any(isinstance(e, Applied) for e in writer.entries)
        # The files were only ever committed through the joint commit, never on their own.
        assert h.store.commits == len(joined) and sum(joined) == 1

    asyncio.run(main())
    assert nemo_read(tmp_path / "checkpoints" / "unit" / "joint") == {"a"}
