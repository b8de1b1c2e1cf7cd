"""Batches, settle steps and commits interleaved at random: the live set never disagrees with the files.

``test_ledger_model`` checks the counting rules with commits made instant. Here the real service
(``CoordinatorService`` over real LMDB completion files, LMDB journal and SQLite registry) runs
several writers of one checkpoint whose batches, settle steps and closes are all in flight at
once, while the group committer's two threads are replaced by lanes that run one call at a time
when the test says so (or fail it): every interleaving of a batch with a completion commit still
on its way (the settle finalizer, another writer's batch, two batches of one writer in flight,
a commit that fails and is retried) is reachable, and each example runs the same way every time.

Once everything is drained, the checkpoint's live set must equal the union of the NeMo Curator
files, every source in it must be completed in some writer's ledger (a source a writer un-completed
through an anomaly, and nobody completed again, is never shown), and a coordinator started again on
the same data directory must answer from the files and never show more than before.

(The test reaches into the service for what no API shows: the committer's lanes, the writers'
ledgers, and whether anything is still settling or being retried.)
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from tally_server.domain.ports import CompletionWriteError
from tally_server.domain.validation import Limits
from tally_server.errors import NotFound, Unavailable
from tally_server.service import CoordinatorService, writers
from tally_server.service.committer import GroupCommitter
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.registry import SqlRegistry, default_sqlite_url
from tests.nemo_format import nemo_read

settings.register_profile(
    "tally-commit-interleavings", max_examples=60, derandomize=True, deadline=None, database=None
)
PROFILE = settings.get_profile("tally-commit-interleavings")

CP = "prop/interleave"
SOURCES = ("s0", "s1")
WRITERS = 2
SETTLE_S = 0.25


class GatedLane:
    """The committer's ``Lane``, run on the event loop: one queued call at a time, when told to.

    Open, it runs each call as it is queued (start-up and draining). Its answer reaches the loop
    as the real lane's does (a callback, then ``then``), so only the timing is the test's.
    """

    def __init__(self) -> None:
        self.queue: deque[tuple[asyncio.Future[Any], Callable[..., Any], tuple[Any, ...], Any]] = deque()
        self.open = True

    def run(self, fn: Callable[..., Any], *args: object, then: Callable[[], None] | None = None) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.queue.append((future, fn, args, then))
        if self.open:
            self.step()
        return future

    def step(self, *, fail: bool = False) -> bool:
        """Run (or fail) the oldest queued call; False if none is queued."""
        if not self.queue:
            return False
        future, fn, args, then = self.queue.popleft()
        loop = asyncio.get_running_loop()
        try:
            if fail:
                raise CompletionWriteError("the disk is full (injected)", path="test", disk_full=True)
            result = fn(*args)
        except Exception as exc:
            loop.call_soon(future.set_exception, exc)
        else:

            def settle() -> None:
                future.set_result(result)
                if then is not None:
                    then()

            loop.call_soon(settle)
        return True

    def drain(self) -> None:
        self.open = True
        while self.step():
            pass

    def shutdown(self) -> None:
        self.drain()


def gate(committer: GroupCommitter) -> tuple[GatedLane, GatedLane]:
    """Put gated lanes in place of the committer's two threads (stopping those)."""
    lanes = GatedLane(), GatedLane()
    for name, lane in zip(("_files_lane", "_journal_lane"), lanes, strict=True):
        getattr(committer, name).shutdown()
        setattr(committer, name, lane)
    return lanes


# --- steps ---------------------------------------------------------------------------------------

# Task ids mostly keep to one source (as lineage ids do); deltas small, so counts touch zero often.
delta = st.builds(
    lambda sid, k, d: (f"{sid}/{k}", sid, d), st.sampled_from(SOURCES), st.integers(0, 3), st.integers(-1, 1)
)
writer = st.integers(0, WRITERS - 1)
batch = st.tuples(st.just("batch"), writer, st.lists(delta, min_size=1, max_size=4))
tick = st.tuples(st.just("tick"), st.sampled_from((0.1, 0.3)))  # time passes, then a settle step
turn = st.tuples(st.just("turn"), st.integers(1, 6))  # the event loop runs what is ready
step = st.one_of(
    batch,
    batch,
    batch,
    tick,
    tick,
    turn,
    turn,
    st.tuples(st.just("files"), st.booleans()),  # one completion-file commit runs (or fails)
    st.tuples(st.just("journal"), st.booleans()),  # one journal commit runs (or fails)
    # A lane opens (its calls run as they come, as on a quiet machine) or closes (they wait).
    st.tuples(st.just("gate"), st.sampled_from(("files", "journal")), st.booleans()),
    st.tuples(st.just("close"), writer),
)


class Run:
    def __init__(self, data_dir: Path, settle_ms: int) -> None:
        self.data_dir = data_dir
        self.now = 1000.0
        self.service = CoordinatorService(
            completions=LmdbCompletionStore(data_dir),
            journal=LogJournal(data_dir),
            registry=SqlRegistry(default_sqlite_url(data_dir)),
            limits=Limits(),
            settle_ms=settle_ms,
            lease_ttl_s=1e6,
            clock=lambda: self.now,
            wall_clock=lambda: self.now,
            sleep=lambda seconds: asyncio.Event().wait(),
        )
        self.files_lane, self.journal_lane = gate(self.service._core.committer)
        self.tasks: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    async def advance(self, seconds: float) -> None:
        """Let time pass normally: the clock loop ticks every 0.1 s (no stall)."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = min(end, self.now + 0.1)
            await self.service.loop("clock").run_once()

    async def turn(self, times: int = 1) -> None:
        for _ in range(times):
            await asyncio.sleep(0)

    async def quiesce(self) -> None:
        """Open the lanes and let everything in flight finish; settle windows run out."""
        self.files_lane.drain()
        self.journal_lane.drain()
        for _ in range(20):
            await self.turn(5)
            await self.advance(2 * SETTLE_S)
            await self.service.loop("settle").run_once()
            if self.tasks:
                done, _ = await asyncio.wait(self.tasks, timeout=10)
                assert len(done) == len(self.tasks), "a call never finished"
                for task in done:
                    # A failed commit (its client would send the batch again), a batch after a close.
                    with contextlib.suppress(Unavailable, NotFound):
                        task.result()
                self.tasks.clear()
            sessions = self.service._core.sessions
            if (
                all(not s.ledger.settling and s.commits_in_flight == 0 for s in sessions)
                and not self.service._durability.undeleted
                and not self.service._durability.finalizers
            ):
                return
        raise AssertionError("the service never became quiet")


async def live(service: CoordinatorService) -> set[str]:
    """The sources the live view answers completed."""
    answers = await service.are_completed(CP, list(SOURCES))
    return {sid for sid, done in zip(SOURCES, answers, strict=True) if done}


@PROFILE
# The settle loop marks s0 completing; the writer's next batch, in the same turn, un-completes it
# before the finalizer queued its commit.
@example(
    settle_ms=250,
    ordered=False,
    lanes_open=True,
    steps=[("batch", 0, [("s0/0", "s0", 0)]), ("turn", 6), ("tick", 0.3), ("batch", 0, [("s0/1", "s0", 1)])],
)
# Writer 1 completed s1, writer 0 completes it too in a batch that also un-completes s0 (two commits
# to wait for), while writer 1 un-completes s1 in the same group commit.
@example(
    settle_ms=0,
    ordered=True,
    lanes_open=True,
    steps=[
        ("batch", 0, [("s1/0", "s1", 1)]),
        ("batch", 1, [("s1/0", "s1", 0)]),
        ("batch", 0, [("s0/0", "s0", 0)]),
        ("turn", 20),  # all three applied and committed
        ("batch", 0, [("s0/1", "s0", 1), ("s1/1", "s1", -1)]),
        ("batch", 1, [("s1/1", "s1", 1)]),
    ],
)
@given(
    settle_ms=st.sampled_from((0, 250)),
    ordered=st.booleans(),
    lanes_open=st.booleans(),
    steps=st.lists(step, min_size=4, max_size=40),
)
def test_live_set_agrees_with_the_files_whatever_the_interleaving(
    settle_ms: int, ordered: bool, lanes_open: bool, steps: list[tuple[Any, ...]]
) -> None:
    # Real time must not decide anything: a batch waits for the one before it as long as it takes.
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(writers, "PREVIOUS_BATCH_WAIT_S", 600.0):
        data_dir = Path(tmp)
        before_restart: set[str] = set()

        async def main() -> None:
            run = Run(data_dir, settle_ms)
            svc = run.service
            await svc.start()
            try:
                handles = [(await svc.open_writer(CP, writer_id=f"w{i}")).handle for i in range(WRITERS)]
                # Their ledgers, kept past a close (a closed writer's completions stand).
                ledgers = [session.ledger for h in handles if (session := svc._core.sessions.get(h))]
                seqs = [0] * WRITERS
                closed: set[int] = set()
                lanes = {"files": run.files_lane, "journal": run.journal_lane}
                run.files_lane.open = run.journal_lane.open = lanes_open
                for kind, *args in steps:
                    if kind == "batch" and args[0] not in closed:
                        w, deltas = args
                        seqs[w] += 1  # each writer's batches in order, two of them may be in flight
                        run.spawn(svc.apply_deltas(handles[w], deltas, seqs[w], ordered=ordered))
                    elif kind == "close" and args[0] not in closed:
                        closed.add(args[0])
                        run.spawn(svc.close_writer(handles[args[0]]))
                    elif kind == "tick":
                        await run.advance(args[0])
                        run.spawn(svc.loop("settle").run_once())
                    elif kind == "turn":
                        await run.turn(args[0])
                    elif kind in ("files", "journal"):
                        lanes[kind].step(fail=args[0])
                    elif kind == "gate":
                        lanes[args[0]].open = args[1]
                        while args[1] and lanes[args[0]].step():
                            pass  # what waited runs now
                await run.quiesce()
                shown = await live(svc)
                own = set().union(*(ledger.own_completed for ledger in ledgers))
                if any(ledger.uncompleted for ledger in ledgers):
                    event("a writer un-completed a source")
                if shown:
                    event("sources completed")
                # Every writer opened on an empty checkpoint: a source is completed only by a writer
                # that completed it and did not un-complete it since.
                unexplained = shown - own
                assert not unexplained, f"{sorted(unexplained)} shown completed but no writer completed them"
                before_restart.update(shown)
            finally:
                await svc.shutdown()
            assert nemo_read(data_dir / "checkpoints" / "prop" / "interleave") == before_restart

        asyncio.run(main())

        async def restarted() -> None:
            run = Run(data_dir, settle_ms)
            svc = run.service
            await svc.start()
            try:
                await run.quiesce()
                after = await live(svc)
                assert after <= before_restart, "a restart completed a source"
                if after != before_restart:
                    event("a restart un-completed a source")
            finally:
                await svc.shutdown()
            assert nemo_read(data_dir / "checkpoints" / "prop" / "interleave") == after

        asyncio.run(restarted())
