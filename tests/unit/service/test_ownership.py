"""A coordinator that owns only some of its store's checkpoints (issue #11, per-checkpoint ownership).

Two services on one store with complementary predicates, run one after the other (the store's
locks are not this level's business): each restores, marks and answers only its own checkpoints,
and leaves the other's writers open and claims held. On the default stores (LMDB files, SQLite
registry, the log journal) and on the PostgreSQL store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tally_server.app import build_service
from tally_server.domain.checkpoint import WriterState
from tally_server.domain.journal import Persisted
from tally_server.domain.ports import DeleteCompleted, ForgetWriter, JournalEntry, PutCompleted
from tally_server.errors import ErrorCode, NotFound, NotOwned, Unavailable
from tally_server.service import CoordinatorService, writers
from tally_server.service.views import ReplicasView
from tally_server.settings import Settings
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.pg_journal import PgJournal
from tally_server.store.postgres import StoreLock, store_url
from tally_server.store.registry import SqlRegistry
from tally_server.store.shards import ShardFence, shard_of
from tests.integration.workload import tree

SHARDS = 4


def a_side(name: str) -> bool:
    return name.startswith("a/")


def b_side(name: str) -> bool:
    return not name.startswith("a/")


@pytest.fixture(params=["lmdb", pytest.param("postgresql", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    """Settings of a coordinator on the default stores, or on a fresh PostgreSQL database."""
    if request.param == "lmdb":
        return Settings(data_dir=tmp_path / "data", settle_ms=0)
    url: str = request.getfixturevalue("postgres_url")
    return Settings(data_dir=tmp_path / "data", settle_ms=0, store=url)


@asynccontextmanager
async def serving(
    settings: Settings, owns: Callable[[str], bool] | None, **overrides: Any
) -> AsyncIterator[CoordinatorService]:
    """A started service on the settings' stores; shut down (writers left open) on exit."""
    service = build_service(settings.model_copy(update=overrides), owns=owns)
    await service.start()
    try:
        yield service
    finally:
        service.stop_accepting()
        await service.shutdown()


def registry_of(settings: Settings) -> SqlRegistry:
    return SqlRegistry(settings.resolved_registry_url())


def states(settings: Settings, checkpoint: str) -> dict[str, str]:
    """Writer id → state, as the registry holds them."""
    with registry_of(settings) as registry:
        return {w.writer_id: w.state for w in registry.list_writers(checkpoint)}


def test_each_of_two_coordinators_restores_and_marks_only_its_own_checkpoints(settings: Settings) -> None:
    async def main() -> None:
        # Writers open when a coordinator without a journal stopped: open in the registry, and
        # nothing brings them back.
        async with serving(settings, None, journal=False) as everything:
            await everything.open_writer("a/stale", writer_id="sa")
            await everything.open_writer("b/stale", writer_id="sb")

        async with serving(settings, a_side) as a:
            assert a.stats.writers_restored == 0
            wa = await a.open_writer("a/live", writer_id="wa")
            await a.apply_deltas(wa.handle, tree("x"))
            assert [c.state for c in await a.acquire(wa.handle, ["ca"])] == ["acquired"]
            names = [c.name for c in (await a.list_checkpoints()).checkpoints]
            assert names == ["a/live", "a/stale"]
        assert states(settings, "a/stale") == {"sa": WriterState.LOST}
        assert states(settings, "b/stale") == {"sb": WriterState.OPEN}  # B's, B is live

        async with serving(settings, b_side) as b:
            assert b.stats.writers_restored == 0  # wa is A's
            assert b.checkpoint_of(wa) is None
            assert [c.name for c in (await b.list_checkpoints()).checkpoints] == ["b/stale"]
            wb = await b.open_writer("b/live", writer_id="wb")
            assert [c.state for c in await b.acquire(wb.handle, ["cb"])] == ["acquired"]
            with pytest.raises(NotOwned, match="'a/live'"):
                await b.get_checkpoint("a/live")
        assert states(settings, "b/stale") == {"sb": WriterState.LOST}
        assert states(settings, "a/live") == {"wa": WriterState.OPEN}  # not marked by B

        async with serving(settings, a_side) as a:
            # Only its own writer comes back from the journal, where it was.
            assert a.stats.writers_restored == 1
            assert a.checkpoint_of(wa.handle) == "a/live" and a.checkpoint_of(wb.handle) is None
            view = await a.get_checkpoint("a/live")
            assert view.completed_count == 1 and [w.writer_id for w in view.writers] == ["wa"]
            assert (await a.token_is_current("a/live", "ca", 1)).current
            assert [c.name for c in (await a.list_checkpoints()).checkpoints] == ["a/live", "a/stale"]
        # B's writer and its claim survived A's start.
        assert states(settings, "b/live") == {"wb": WriterState.OPEN}
        assert states(settings, "a/live") == {"wa": WriterState.OPEN}
        with registry_of(settings) as registry:
            claims = {(c.checkpoint, c.source_id, c.writer_id) for c in registry.live_claims()}
        assert claims == {("a/live", "ca", "wa"), ("b/live", "cb", "wb")}

        async with serving(settings, b_side) as b:
            assert b.stats.writers_restored == 1 and b.checkpoint_of(wb.handle) == "b/live"
            assert (await b.token_is_current("b/live", "cb", 1)).current

    asyncio.run(main())


def unowned_calls(svc: CoordinatorService, cp: str) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every call naming a checkpoint, on ``cp``."""

    async def watch() -> object:
        async for view in svc.watch(cp):
            return view
        return None

    return {
        "open_writer": lambda: svc.open_writer(cp, writer_id="w"),
        "are_completed": lambda: svc.are_completed(cp, ["s"]),
        "get_checkpoint": lambda: svc.get_checkpoint(cp),
        "list_writers": lambda: svc.list_writers(cp, include_closed=True),
        "list_events": lambda: svc.list_events(cp),
        "progress": lambda: svc.progress(cp),
        "watch": watch,
        "get_cursor": lambda: svc.get_cursor(cp, "s"),
        "list_completed": lambda: svc.list_completed(cp),
        "list_failures": lambda: svc.list_failures(cp),
        "retry_failed": lambda: svc.retry_failed(cp),
        "set_failure_budget": lambda: svc.set_failure_budget(cp, 3),
        "token_is_current": lambda: svc.token_is_current(cp, "s", 1),
        "declare_sources": lambda: svc.declare_sources(cp, ["s"], 5),
        "list_remaining": lambda: svc.list_remaining(cp),
        "import_completed": lambda: svc.import_completed(cp, ["s"], import_id="imp"),
        "reset_checkpoint": lambda: svc.reset_checkpoint(cp, force=True),
    }


def test_a_call_naming_a_checkpoint_it_does_not_own_is_refused_and_changes_nothing(
    settings: Settings,
) -> None:
    async def main() -> None:
        async with serving(settings, None) as everything:  # b/other exists, with a writer
            await everything.open_writer("b/other", writer_id="w0")
        async with serving(settings, a_side) as a:
            a.serve_replicas("replica-a", lambda: ReplicasView([], 0, answered_by="replica-a"))
            await a.open_writer("a/mine", writer_id="wa")
            for cp in ("b/other", "b/new"):
                for name, call in unowned_calls(a, cp).items():
                    with pytest.raises(NotOwned) as refused:
                        await call()
                    error = refused.value
                    assert isinstance(error, Unavailable) and error.code is ErrorCode.UNAVAILABLE, name
                    assert f"checkpoint {cp!r} is not owned by this coordinator" in error.message, name
                    assert "replica 'replica-a'" in error.message and "retry" in error.message, name
                    assert error.details == {"checkpoint": cp, "replica": "replica-a"}, name
            assert [c.name for c in (await a.list_checkpoints()).checkpoints] == ["a/mine"]
            assert await a.are_completed("a/mine", ["s"]) == [False]  # its own are answered
        with registry_of(settings) as registry:
            assert [r.name for r in registry.list_checkpoints()] == ["a/mine", "b/other"]
            assert [w.writer_id for w in registry.list_writers("b/other")] == ["w0"]
            assert registry.list_failures("b/other") == [] and registry.budget_of("b/other") == 0
            assert registry.list_declared() == ({}, {})
            assert registry.list_events("b/new") == []
        assert states(settings, "b/other") == {"w0": WriterState.OPEN}
        assert not (settings.data_dir / "checkpoints" / "b").exists()

    asyncio.run(main())


def test_without_a_predicate_a_coordinator_owns_every_checkpoint(settings: Settings) -> None:
    async def main() -> None:
        async with serving(settings, None) as first:
            for cp in ("a/one", "b/two"):
                opened = await first.open_writer(cp, writer_id="w")
                await first.apply_deltas(opened.handle, tree("x"))
        async with serving(settings, None) as again:
            assert again.stats.writers_restored == 2
            names = [c.name for c in (await again.list_checkpoints()).checkpoints]
            assert names == ["a/one", "b/two"]
            assert await again.are_completed("b/two", ["x"]) == [True]

    asyncio.run(main())


@pytest.mark.parametrize(("owns", "drops"), [(None, True), (a_side, False)])
def test_statuses_are_published_without_dropping_other_owners_rows(
    tmp_path: Path, owns: Callable[[str], bool] | None, drops: bool
) -> None:
    published: list[tuple[list[str], list[str] | None]] = []

    def publish(changed: Any, keep: Any) -> bool:
        published.append((sorted(changed), None if keep is None else sorted(keep)))
        return True

    async def main() -> None:
        async with serving(Settings(data_dir=tmp_path / "data", settle_ms=0), owns) as svc:
            svc.serve_replicas("replica-a", lambda: ReplicasView([], 0, answered_by=""), publish)
            await svc.open_writer("a/one", writer_id="w")
            await svc.loop("status").run_once()

    asyncio.run(main())
    # The first publication replaces the table's rows where one coordinator owns the whole store;
    # a coordinator owning some checkpoints leaves the other rows to their owners.
    # (The status loop also runs by itself every half second: what it published is checked alike.)
    assert any("a/one" in changed for changed, _ in published)
    assert [keep is not None for _, keep in published][:1] == [drops]
    assert all(keep in (None, [], ["a/one"]) if drops else keep is None for _, keep in published)


async def _fill(svc: CoordinatorService, cp: str, writer_id: str) -> str:
    """A writer on ``cp`` with a completion, a pending source, a claim, a failure
    at a budget and declared sources; returns its handle."""
    opened = await svc.open_writer(cp, writer_id=writer_id)
    await svc.apply_deltas(opened.handle, tree("x"))
    await svc.apply_deltas(opened.handle, tree("half")[:2])
    assert [c.state for c in await svc.acquire(opened.handle, ["claimed"])] == ["acquired"]
    await svc.set_failure_budget(cp, 1)
    assert (await svc.report_failure(opened.handle, "bad", "boom")).failed
    await svc.declare_sources(cp, ["x", "y", "bad"])
    await svc.flush(opened.handle)
    return opened.handle


def _summary(view: Any) -> tuple[Any, ...]:
    return (
        view.completed_count,
        view.pending_sources,
        [w.writer_id for w in view.writers],
        view.failed_sources,
        view.max_attempts,
        view.total,
        view.remaining,
        view.claimed_sources,
    )


def test_a_running_coordinator_adopts_checkpoints_and_keeps_its_own_as_they_were(settings: Settings) -> None:
    """``adopt`` restores the adopted checkpoints as ``start`` would (writers from the journal,
    counts, claims, failures, budgets, declared sources; stale writers marked lost) and changes
    nothing of what the service served already, which it goes on serving meanwhile."""

    async def main() -> None:
        async with serving(settings, None, journal=False) as everything:
            await everything.open_writer("a/stale", writer_id="sa")
        async with serving(settings, a_side) as a:
            wa = await _fill(a, "a/live", "wa")
            a_before = _summary(await a.get_checkpoint("a/live"))
        assert a_before == (1, 1, ["wa"], 1, 1, 3, 2, 1)

        async with serving(settings, b_side) as b:
            wb = await _fill(b, "b/live", "wb")
            b_before = _summary(await b.get_checkpoint("b/live"))
            assert b.checkpoint_of(wa) is None
            with pytest.raises(NotOwned):
                await b.get_checkpoint("a/live")
            adopting = asyncio.get_running_loop().create_task(b.adopt(a_side))
            await asyncio.sleep(0)  # the adoption waits on its first registry read
            assert not adopting.done()
            # Meanwhile: the adopted checkpoints are not served yet, the service's own are.
            with pytest.raises(NotOwned):
                await b.get_checkpoint("a/live")
            # A writer brought back from the journal waits until its checkpoint is owned (the
            # adoption awaits registry reads and a write after restoring it: this loop sees that).
            refused = served = 0
            while not adopting.done():
                if b.checkpoint_of(wa) is not None:
                    with pytest.raises(NotOwned):
                        await b.keep_alive(wa)
                    refused += 1
                assert _summary(await b.get_checkpoint("b/live")) == b_before
                served += 1
                await asyncio.sleep(0)
            assert refused and served
            assert await adopting == 1
            await b.apply_deltas(wb, tree("y"))
            assert b.stats.writers_restored == 1
            # Adopted, where it was: its writer (same handle), counts, claim, failure, totals.
            assert b.checkpoint_of(wa) == "a/live"
            assert _summary(await b.get_checkpoint("a/live")) == a_before
            assert (await b.token_is_current("a/live", "claimed", 1)).current
            failures = await b.list_failures("a/live")
            assert [(f.source_id, f.failed) for f in failures.sources] == [("bad", True)]
            await b.apply_deltas(wa, tree("half")[2:])
            await b.flush(wa)
            assert await b.are_completed("a/live", ["x", "half", "y"]) == [True, True, False]
            # Its own are untouched (the failure, budget, declared sources, claim, writer).
            after = _summary(await b.get_checkpoint("b/live"))
            assert after == (b_before[0] + 1, *b_before[1:6], b_before[6] - 1, b_before[7])
            assert [f.source_id for f in (await b.list_failures("b/live")).sources] == ["bad"]
            assert (await b.token_is_current("b/live", "claimed", 1)).current
            names = [c.name for c in (await b.list_checkpoints()).checkpoints]
            assert names == ["a/live", "a/stale", "b/live"]
        # Only the adopted side's stale writer was marked lost; both journaled writers are open.
        assert states(settings, "a/stale") == {"sa": WriterState.LOST}
        assert states(settings, "a/live") == {"wa": WriterState.OPEN}
        assert states(settings, "b/live") == {"wb": WriterState.OPEN}

    asyncio.run(main())


def test_a_coordinator_owning_every_checkpoint_has_nothing_to_adopt(tmp_path: Path) -> None:
    async def main() -> None:
        async with serving(Settings(data_dir=tmp_path / "data", settle_ms=0), None) as svc:
            with pytest.raises(ValueError, match="nothing to adopt"):
                await svc.adopt(a_side)

    asyncio.run(main())


def everything(name: str) -> bool:
    return True


def test_a_running_coordinator_gives_checkpoints_up_and_keeps_its_own_as_they_were(
    settings: Settings,
) -> None:
    """``release`` lets the calls at work on the released checkpoints finish, makes their writers'
    journals durable and forgets them, refusing their calls from then on, while the service's own
    are answered and left as they were; their writers stay open (neither closed nor lost), and a
    coordinator adopting them finds everything where it was, the calls that were at work included."""

    async def main() -> None:
        async with serving(settings, everything) as both:
            wa = await _fill(both, "a/live", "wa")
            wb = await _fill(both, "b/live", "wb")
            b_before = _summary(await both.get_checkpoint("b/live"))
            # Calls at work on a/live as the release starts: a batch (its commit under way) and a
            # declaration (its registry write under way).
            loop = asyncio.get_running_loop()
            applying = loop.create_task(both.apply_deltas(wa, tree("late")))
            declaring = loop.create_task(both.declare_sources("a/live", ["later"]))
            await asyncio.sleep(0)
            assert not applying.done() and not declaring.done()
            assert await both.release(a_side, owns=b_side) == 1
            # Both finished (and were answered) before the release returned.
            assert applying.done() and applying.result().counts.completed == 1
            assert declaring.done() and declaring.result() == (4, 3)
            # a/live is refused from now on, its writer unknown here; b/live is served as it was.
            with pytest.raises(NotOwned):
                await both.get_checkpoint("a/live")
            with pytest.raises(NotOwned):
                await both.declare_sources("a/live", ["x"])
            # Its writer's calls too (UNAVAILABLE, retried at its next owner; never NOT_FOUND).
            with pytest.raises(NotOwned):
                await both.apply_deltas(wa, tree("z"))
            with pytest.raises(NotOwned):
                await both.flush(wa)
            assert both.checkpoint_of(wa) is None
            assert [c.name for c in (await both.list_checkpoints()).checkpoints] == ["b/live"]
            assert _summary(await both.get_checkpoint("b/live")) == b_before
            await both.apply_deltas(wb, tree("y"))
            await both.flush(wb)
            assert await both.are_completed("b/live", ["x", "y", "half"]) == [True, True, False]
            assert (await both.token_is_current("b/live", "claimed", 1)).current
        # Neither writer was closed or marked lost.
        assert states(settings, "a/live") == {"wa": WriterState.OPEN}
        assert states(settings, "b/live") == {"wb": WriterState.OPEN}

        async with serving(settings, a_side) as a:
            assert a.stats.writers_restored == 1
            # Where it was, with the late batch ('late' completed) and declaration ('later').
            assert _summary(await a.get_checkpoint("a/live")) == (2, 1, ["wa"], 1, 1, 4, 3, 1)
            assert await a.are_completed("a/live", ["x", "late", "half"]) == [True, True, False]
            assert (await a.token_is_current("a/live", "claimed", 1)).current
            await a.apply_deltas(wa, tree("half")[2:])  # the same handle, its pending source too
            await a.flush(wa)
            assert await a.are_completed("a/live", ["half"]) == [True]
            assert (await a.get_checkpoint("a/live")).anomalies == 0

    asyncio.run(main())


def test_the_handles_of_writers_let_go_are_forgotten_after_a_while(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle let go with its checkpoint answers a late call UNAVAILABLE, but only for
    ``RELEASED_KEPT_S``: the next release forgets the handles older than that, so a coordinator
    that hands shards over for weeks does not remember every writer it ever let go."""

    async def main() -> None:
        async with serving(settings, everything) as svc:
            one = (await svc.open_writer("a/one", writer_id="w1")).handle
            two = (await svc.open_writer("a/two", writer_id="w2")).handle
            await svc.release(lambda name: name == "a/one", owns=lambda name: name != "a/one")
            with pytest.raises(NotOwned):
                await svc.flush(one)
            monkeypatch.setattr(writers, "RELEASED_KEPT_S", 0.0)
            await svc.release(lambda name: name == "a/two", owns=lambda name: name.startswith("b/"))
            for handle in (one, two):
                with pytest.raises(NotFound):
                    await svc.flush(handle)

    asyncio.run(main())


def test_a_flush_at_work_when_its_checkpoint_is_given_up_returns_once_its_completions_are_durable(
    settings: Settings,
) -> None:
    """A flush waiting for a settle window as the release starts: the release waits for it (the
    settle step completes the source), so the flush is answered, durably, before the checkpoint
    leaves; a coordinator adopting it finds the source completed."""

    async def main() -> None:
        async with serving(settings, everything, settle_ms=300) as svc:
            w = await svc.open_writer("a/slow", writer_id="w")
            await svc.apply_deltas(w.handle, tree("s"))  # settling for 300 ms
            flushing = asyncio.get_running_loop().create_task(svc.flush(w.handle))
            await asyncio.sleep(0)
            assert not flushing.done()
            assert await svc.release(a_side, owns=b_side) == 1
            assert flushing.done() and flushing.result() == 1
        async with serving(settings, a_side) as a:
            assert a.stats.writers_restored == 1
            assert await a.are_completed("a/slow", ["s"]) == [True]
            assert (await a.get_checkpoint("a/slow")).pending_sources == 0

    asyncio.run(main())


def test_a_coordinator_drops_checkpoints_taken_over_without_a_false_flush_and_keeps_its_own(
    settings: Settings,
) -> None:
    """``lose`` (a shard taken over by another coordinator): nothing of its checkpoints is flushed
    (it could not be written), a flush waiting on one of its writers fails as UNAVAILABLE instead of
    answering, their calls are refused from then on, the service's own are served, and their next
    owner carries the writer on from the journal."""

    async def main() -> None:
        async with serving(settings, everything, settle_ms=300) as svc:
            wa = (await svc.open_writer("a/live", writer_id="wa")).handle
            wb = (await svc.open_writer("b/live", writer_id="wb")).handle
            await svc.apply_deltas(wa, tree("s"))  # settling for 300 ms
            flushing = asyncio.get_running_loop().create_task(svc.flush(wa))
            await asyncio.sleep(0)
            assert not flushing.done()
            await svc.apply_deltas(wb, tree("t"))
            assert await svc.lose(a_side, owns=b_side) == 1
            with pytest.raises(Unavailable, match="moved to another coordinator while flushing"):
                await flushing
            with pytest.raises(NotOwned):
                await svc.apply_deltas(wa, tree("u"))
            with pytest.raises(NotOwned):
                await svc.get_checkpoint("a/live")
            assert await svc.flush(wb) == 1
            assert await svc.are_completed("b/live", ["t"]) == [True]
        assert states(settings, "a/live") == {"wa": WriterState.OPEN}
        async with serving(settings, a_side, settle_ms=300) as a:
            assert a.stats.writers_restored == 1
            assert await a.flush(wa) == 1  # its settling source completes there
            assert await a.are_completed("a/live", ["s"]) == [True]

    asyncio.run(main())


@pytest.mark.postgres
def test_a_write_for_a_shard_given_up_is_refused_once_its_lock_left_the_fence(
    tmp_path: Path, postgres_url: str
) -> None:
    """The safety net behind ``release``: a commit carrying a checkpoint of a shard no longer in the
    service's ``ShardFence`` is refused, even though every shard the fence reads is still ours; the
    shard kept is written as before."""
    url = store_url(postgres_url)
    by_shard = {shard_of(n, SHARDS): n for n in (f"cp/{i}" for i in range(50))}
    kept, gone = by_shard[1], by_shard[2]
    locks = {shard: StoreLock(url, "a", shard=shard) for shard in (1, 2)}
    for lock in locks.values():
        lock.acquire()
    fence = ShardFence(locks, store_shards=SHARDS)
    settings = Settings(data_dir=tmp_path / "data", settle_ms=0, store=postgres_url)

    def in_shards(*shards: int) -> Callable[[str], bool]:
        return lambda name: shard_of(name, SHARDS) in shards

    async def main() -> None:
        service = build_service(settings, fence=fence, owns=in_shards(1, 2))
        await service.start()
        try:
            wk = await service.open_writer(kept, writer_id="wk")
            wg = await service.open_writer(gone, writer_id="wg")
            for handle in (wk.handle, wg.handle):
                await service.apply_deltas(handle, tree("a"))
            await service.release(in_shards(2), owns=in_shards(1))
            assert fence.remove(2) is locks[2]
            locks[2].release()
            committer = service._core.committer
            late: list[Any] = [
                PutCompleted(gone, "wg", ["late"]),
                DeleteCompleted(gone, ["a"]),
                JournalEntry(wg.handle, 99, Persisted(["a"]), gone),
                ForgetWriter(wg.handle, gone),
            ]
            for op in late:
                with pytest.raises(Unavailable, match="no longer holds shard 2 of the PostgreSQL store"):
                    await committer.submit(op)
            # With a write of the shard kept in the same group: that one is written, the late one
            # alone refused.
            together = [committer.enqueue(PutCompleted(kept, "wk", ["b"])), committer.enqueue(late[0])]
            ok, refused = await asyncio.gather(*together, return_exceptions=True)
            assert ok is None
            assert isinstance(refused, Unavailable) and "no longer holds shard 2" in refused.message
            # The shard kept goes on.
            await service.apply_deltas(wk.handle, tree("c"))
            await service.flush(wk.handle)
            assert await service.are_completed(kept, ["a", "c"]) == [True, True]
        finally:
            service.stop_accepting()
            await service.shutdown()

    asyncio.run(main())
    locks[1].release()
    with PgCompletionStore(postgres_url) as store:
        assert store.load(gone).completed == {"a"}  # neither "late" nor the un-complete of "a"
        assert store.load(kept).completed == {"a", "b", "c"}
    with registry_of(settings) as registry:
        assert {w.writer_id: w.state for w in registry.list_writers(gone)} == {"wg": WriterState.OPEN}
    journal = PgJournal(postgres_url)
    try:
        (writer,) = [w for w in journal.load() if w.opened.checkpoint == gone]
        assert writer.last_index < 99  # the late entry was not written; the writer's journal stays
    finally:
        journal.close()
