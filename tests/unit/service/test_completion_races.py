"""A completion in flight meeting an anomaly for the same source: no source stays completed that is not.

A source that completes is committed first and joins the live set once durable; an anomaly takes
it out of the live set at once and commits its un-complete in every file. When the completion is
still being committed as the anomaly comes (the settle loop's finalizer, or another writer's batch
in the same group commit), whichever lands last must not leave the source completed in the live set
or in a file, and the live set must agree with the files.

Real stores (LMDB files, LMDB journal, SQLite registry) in a temporary directory, a fake clock, and
the service's background steps run by hand (as in ``test_coordinator``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    DeleteCompleted,
    ForgetWriter,
    JournalOp,
    PutCompleted,
)
from tally_server.service.committer import GroupCommitter
from tally_server.service.stats import ServiceStats
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tests.integration.workload import tree
from tests.nemo_format import nemo_read
from tests.unit.service.test_coordinator import Clock, Harness, coordinator

CP = "unit/race"


class HeldStore(LmdbCompletionStore):
    """The real store, whose commits of one kind can be held on the commit thread until released."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.hold: type[PutCompleted] | type[DeleteCompleted] | None = None
        self.entered = threading.Event()  # a held commit is waiting
        self.release = threading.Event()
        self.commits = 0

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        self.commits += 1
        if self.hold is not None and any(isinstance(op, self.hold) for op in ops):
            self.hold = None
            self.entered.set()
            self.release.wait(10)
        return super().commit(ops)

    async def held(self) -> None:
        """Return once a held commit is waiting on the commit thread; arm for the next hold."""
        assert await asyncio.to_thread(self.entered.wait, 10)
        self.entered.clear()

    def let_go(self) -> None:
        self.release.set()
        self.release = threading.Event()


def run(
    tmp_path: Path, scenario: Callable[[Harness, HeldStore], Awaitable[None]], *, settle_ms: int = 250
) -> None:
    async def main() -> None:
        clock = Clock()
        store = HeldStore(tmp_path)
        service = coordinator(tmp_path, store, clock, settle_ms)
        await service.start()
        try:
            await scenario(Harness(service, clock, store), store)  # type: ignore[arg-type]
        finally:
            await service.shutdown()

    asyncio.run(main())


def files(tmp_path: Path, checkpoint: str = CP) -> set[str]:
    return nemo_read(tmp_path.joinpath("checkpoints", *checkpoint.split("/")))


def live_after_restart(tmp_path: Path, sources: list[str], *, close: str = "") -> list[bool]:
    """What a coordinator started again on the same data directory answers (its writers restored),
    after closing the writer with handle ``close``, if given."""
    answer: list[bool] = []

    async def scenario(h: Harness, store: HeldStore) -> None:
        if close:
            await h.service.close_writer(close)
        answer.extend(await h.service.are_completed(CP, sources))

    run(tmp_path, scenario)
    return answer


def test_an_anomaly_before_the_settle_finalizer_commits_wins_over_it(tmp_path: Path) -> None:
    """The settle loop marks "a" completing; the late delta comes before its commit is even queued.

    Before the fix the anomaly's un-complete was committed first and the completion after it: "a"
    stood completed in the file and the live set although the writer reported an anomaly.
    """

    handle = ""

    async def scenario(h: Harness, store: HeldStore) -> None:
        nonlocal handle
        svc = h.service
        opened = await svc.open_writer(CP, writer_id="w")
        handle = opened.handle
        await svc.apply_deltas(opened.handle, tree("a"))
        await h.advance(0.3)
        await h.step("settle")  # "a" is completing; its finalizer has not run yet
        late = await svc.apply_deltas(opened.handle, [("late", "a", 1)])
        assert late.counts.anomalies == 1
        assert await svc.are_completed(CP, ["a"]) == [False]
        await svc.flush(opened.handle)
        assert await svc.are_completed(CP, ["a"]) == [False]
        assert (await svc.get_checkpoint(CP)).completed_count == 0

    run(tmp_path, scenario)
    assert files(tmp_path) == set()
    assert live_after_restart(tmp_path, ["a"]) == [False]
    # The writer restored from its journal, then closed: nothing is left to bring "a" back.
    assert live_after_restart(tmp_path, ["a"], close=handle) == [False]
    assert live_after_restart(tmp_path, ["a"]) == [False]
    assert files(tmp_path) == set()


def test_an_anomaly_while_the_finalizer_commit_is_on_disk_never_shows_the_source(tmp_path: Path) -> None:
    """The completion's commit is under way when the late delta comes: it lands first, the
    un-complete after it, and "a" is never visible in between."""

    async def scenario(h: Harness, store: HeldStore) -> None:
        svc = h.service
        opened = await svc.open_writer(CP, writer_id="w")
        await svc.apply_deltas(opened.handle, tree("a"))
        await h.advance(0.3)
        store.hold = PutCompleted
        await h.step("settle")
        await store.held()  # the completion of "a" is being committed
        late = asyncio.ensure_future(svc.apply_deltas(opened.handle, [("late", "a", 1)]))
        store.hold = DeleteCompleted
        store.let_go()
        await store.held()  # the completion is durable; the un-complete is being committed
        assert await svc.are_completed(CP, ["a"]) == [False]  # the doubtful completion is never shown
        store.let_go()
        assert (await late).counts.anomalies == 1
        await svc.flush(opened.handle)
        assert await svc.are_completed(CP, ["a"]) == [False]

    run(tmp_path, scenario)
    assert files(tmp_path) == set()
    assert live_after_restart(tmp_path, ["a"]) == [False]


def test_a_completion_and_another_writers_later_anomaly_in_one_group_agree_with_the_files(
    tmp_path: Path,
) -> None:
    """Writer a completes "s" (with an anomaly of its own in the same batch: two commits to wait
    for); writer b, which completed "s" earlier, un-completes it in the same group commit.

    Before the fix, a's made_durable ran after b's un-complete: "s" was in the live set while the
    files (a's put, then b's delete everywhere) had it nowhere.
    """

    async def scenario(h: Harness, store: HeldStore) -> None:
        svc = h.service
        a = await svc.open_writer(CP, writer_id="a")
        b = await svc.open_writer(CP, writer_id="b")
        await svc.apply_deltas(b.handle, tree("s"))  # b completes s
        await svc.apply_deltas(a.handle, tree("x") + tree("s")[:-1])  # a completes x, s one short
        before = store.commits
        # Both batches are queued before the group commit runs: one group, a's put before b's delete.
        first = asyncio.ensure_future(svc.apply_deltas(a.handle, [("x-late", "x", 1), tree("s")[-1]]))
        second = asyncio.ensure_future(svc.apply_deltas(b.handle, [("s-late", "s", 1)]))
        assert (await first).counts.completed == 1
        assert (await second).counts.anomalies == 1
        assert store.commits == before + 1  # one group
        assert await svc.are_completed(CP, ["s", "x"]) == [False, False]

    run(tmp_path, scenario, settle_ms=0)
    assert files(tmp_path) == set()


@pytest.mark.parametrize("joint", [False, True], ids=["two-stage", "joint"])
def test_submitters_resume_in_the_order_they_queued(tmp_path: Path, joint: bool) -> None:
    """The order live-set effects are applied in: the order their commits were queued (so the order
    the files saw them), whether a submitter waits for one future or several, with a journal entry
    or without.

    Before the fix a submitter waiting for several futures resumed behind one queued after it
    (``gather``'s extra turn), and with a joint commit every journal-bearing submitter resumed
    before every one without a journal entry.
    """
    resumed: list[str] = []

    async def main() -> None:
        store, journal = LmdbCompletionStore(tmp_path), LogJournal(tmp_path)

        def both(entries: Sequence[JournalOp], changes: Sequence[CompletionOp]) -> CommitReport:
            journal.commit(entries)
            return store.commit(changes)

        committer = GroupCommitter(store, journal, ServiceStats(), joint=both if joint else None)
        committer.start()

        async def submitter(name: str, ops: Sequence[JournalOp | CompletionOp]) -> None:
            futures = [committer.enqueue(op) for op in ops]  # as Durability.commit queues them
            for future in futures:
                await future
            resumed.append(name)

        try:
            # Queued in this order, in one group (the commit loop runs after all of them queued).
            await asyncio.gather(
                submitter("delete s, no journal", [DeleteCompleted(CP, ["s"])]),
                submitter("journal, put s", [ForgetWriter("h1"), PutCompleted(CP, "a", ["s"])]),
                submitter("delete s and x", [DeleteCompleted(CP, ["s"]), DeleteCompleted(CP, ["x"])]),
                submitter("put s", [PutCompleted(CP, "b", ["s"])]),
            )
        finally:
            await committer.close()
            store.close()
            journal.close()

    asyncio.run(main())
    assert resumed == ["delete s, no journal", "journal, put s", "delete s and x", "put s"]
    assert files(tmp_path) == {"s"}
