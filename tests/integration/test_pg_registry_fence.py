"""The registry's writes on a PostgreSQL store are fenced by the epochs of their checkpoints' shards.

Against the real local PostgreSQL, a fresh database per test: the registry in the store's database,
given the coordinator's ``ShardFence`` (``store.registry_fence``). A write about a checkpoint of a
shard whose epoch moved on (another coordinator took it), or of a shard no longer in the fence, is
refused as a whole and writes nothing; one of a shard still held passes (and on a store of one
shard, the store's lock fences them alike). A coordinator service that loses a shard can record
nothing of that shard's checkpoints afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tally_server.app import build_service
from tally_server.domain.checkpoint import WriterState
from tally_server.domain.events import EventKind
from tally_server.domain.ports import (
    CheckpointRecord,
    CursorRecord,
    EventRecord,
    FailedAttemptRecord,
    ProgressRecord,
    WriterRecord,
)
from tally_server.errors import RegistryFenced, Unavailable
from tally_server.settings import Settings
from tally_server.store.postgres import StoreLock, store_url
from tally_server.store.registry import SqlRegistry
from tally_server.store.registry_schema import (
    budgets_table,
    checkpoints_table,
    claims_table,
    cursors_table,
    declared_counts_table,
    declared_table,
    events_table,
    failures_table,
    progress_table,
    writers_table,
)
from tally_server.store.shards import ShardFence, shard_of
from tests.integration.test_pg_shards import lock_session, name_in, take
from tests.integration.workload import tree
from tests.pg_sessions import end_sessions

pytestmark = pytest.mark.postgres

SHARDS = 4
_TABLES = (
    checkpoints_table,
    writers_table,
    events_table,
    progress_table,
    cursors_table,
    failures_table,
    budgets_table,
    claims_table,
    declared_table,
    declared_counts_table,
)


def registry_rows(url: str) -> dict[str, list[str]]:
    """Every row of every registry table, by table (rows as text, sorted): what a write changed."""
    engine = sa.create_engine(store_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return {t.name: sorted(repr(tuple(r)) for r in conn.execute(sa.select(t))) for t in _TABLES}
    finally:
        engine.dispose()


def rows_of(name: str, rows: dict[str, list[str]]) -> dict[str, list[str]]:
    """The rows of ``registry_rows`` that are about checkpoint ``name``."""
    return {table: [r for r in found if repr(name) in r] for table, found in rows.items()}


def writer(handle: str, checkpoint: str, state: str = WriterState.OPEN) -> WriterRecord:
    return WriterRecord(handle, checkpoint, f"w-{handle}", "host", 1, {}, {}, state, 1.0, 1.0)


def take_over(locks: list[StoreLock], url: str, lock: StoreLock) -> StoreLock:
    """Another coordinator takes ``lock``'s shard, as after a pause: its session ended, its epoch bumped."""
    end_sessions(url, [lock_session(lock)])
    return take(locks, url, "b", lock.shard, wait_s=10)


def every_write(registry: SqlRegistry, name: str, handle: str) -> list[Callable[[], object]]:
    """One call of each registry write about checkpoint ``name`` (its writer ``handle``)."""
    attempt = FailedAttemptRecord("boom", 2.0, f"w-{handle}")
    return [
        lambda: registry.write_batch(checkpoints=[CheckpointRecord(name, 1.0, 2.0)]),
        lambda: registry.write_batch(writers=[writer(handle, name, WriterState.CLOSED)]),
        lambda: registry.write_batch(events=[EventRecord(name, EventKind.ANOMALY, "late", 2.0)]),
        lambda: registry.write_batch(samples=[ProgressRecord(name, 2.0, 5)]),
        lambda: registry.mark_open_writers(WriterState.LOST, 2.0),
        lambda: registry.mark_open_writers(WriterState.LOST, 2.0, owns={name}.__contains__),
        lambda: registry.take_claims(name, ["s1", "s2"], handle, f"w-{handle}", 2.0),
        lambda: registry.release_claims(name, handle),
        lambda: registry.release_claims(name, handle, ["s0"]),
        lambda: registry.save_cursors([CursorRecord(name, "s1", b"at 5", 2.0, f"w-{handle}")]),
        lambda: registry.delete_cursors(name),
        lambda: registry.delete_cursors(name, ["s0"]),
        lambda: registry.record_failure(name, "s1", attempt, 5),
        lambda: registry.clear_failures(name),
        lambda: registry.clear_failures(name, ["s0"]),
        lambda: registry.set_budget(name, 7),
        lambda: registry.add_declared(name, ["d1", "d2"], 9),
        lambda: registry.delete_samples(name),
    ]


def seed(registry: SqlRegistry, name: str, handle: str) -> None:
    """A checkpoint's rows of each kind, for the writes above to change."""
    registry.write_batch(
        checkpoints=[CheckpointRecord(name, 1.0, 1.0)],
        writers=[writer(handle, name)],
        events=[EventRecord(name, EventKind.WRITER_OPENED, "opened", 1.0)],
        samples=[ProgressRecord(name, 1.0, 1)],
    )
    registry.take_claims(name, ["s0"], handle, f"w-{handle}", 1.0)
    registry.save_cursors([CursorRecord(name, "s0", b"at 1", 1.0, f"w-{handle}")])
    registry.record_failure(name, "s0", FailedAttemptRecord("first", 1.0, f"w-{handle}"), 5)


def test_a_registry_write_for_a_shard_taken_by_another_coordinator_is_refused_and_writes_nothing(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=SHARDS)
    kept, gone = name_in(1, SHARDS, "k"), name_in(2, SHARDS, "g")
    with SqlRegistry(postgres_url, fence=fence) as registry:
        seed(registry, kept, "hk")
        seed(registry, gone, "hg")
        for write in every_write(registry, gone, "hg"):  # shard 2 still ours: each one passes
            write()
        seed(registry, gone, "hg2")
        take_over(locks, postgres_url, two)
        before = registry_rows(postgres_url)
        for i, write in enumerate(every_write(registry, gone, "hg2")):
            with pytest.raises(RegistryFenced, match="no longer owns shard 2 of the PostgreSQL store") as no:
                write()
            assert no.value.shard == 2, i
            assert no.value.refused == {gone}, i
        # A batch with rows of a shard kept is refused as a whole; only the lost shard's rows are
        # named as never passing here.
        with pytest.raises(RegistryFenced) as mixed:
            registry.write_batch(writers=[writer("hk", kept, WriterState.CLOSED), writer("hg2", gone)])
        assert mixed.value.refused == {gone}
        assert registry_rows(postgres_url) == before  # nothing of any refused write was written
        # While the lost shard is still in the fence (its loss not noticed yet), every write of the
        # shard kept passes: it is fenced by shard 1's epoch alone.
        for i, write in enumerate(every_write(registry, kept, "hk")):
            if i != 4:  # marking every open writer: shard 2's too (refused, as above)
                write()
        assert {w.handle: w.state for w in registry.list_writers(kept)} == {"hk": WriterState.CLOSED}
        assert registry.budget_of(kept) == 7
        registry.write_batch(writers=[writer("hk", kept, WriterState.LOST)])
        assert {w.handle: w.state for w in registry.list_writers(kept)} == {"hk": WriterState.LOST}
        assert rows_of(gone, registry_rows(postgres_url)) == rows_of(gone, before)  # shard 2's untouched


def test_a_registry_write_for_a_shard_held_passes_and_one_of_a_shard_left_the_fence_does_not(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=SHARDS)
    kept, gone, never = name_in(1, SHARDS, "k"), name_in(2, SHARDS, "g"), name_in(3, SHARDS, "n")
    with SqlRegistry(postgres_url, fence=fence) as registry:
        seed(registry, kept, "hk")
        seed(registry, gone, "hg")
        take_over(locks, postgres_url, two)
        assert fence.remove(2) is two  # dropped, as serve_shards drops a lost shard
        for i, write in enumerate(every_write(registry, kept, "hk")):  # shard 1 is still ours
            if i != 4:  # marking every open writer: shard 2's too (below)
                write()
        assert {w.handle: w.state for w in registry.list_writers(kept)} == {"hk": WriterState.CLOSED}
        assert registry.budget_of(kept) == 7
        before = registry_rows(postgres_url)
        for name, shard in ((gone, 2), (never, 3)):
            for i, write in enumerate(every_write(registry, name, "hg")):
                if name == never and i in (4, 5):
                    continue  # no writer of shard 3 to mark: nothing written, nothing fenced
                with pytest.raises(RegistryFenced, match=f"no longer holds shard {shard} ") as no:
                    write()
                assert (no.value.shard, no.value.refused) == (shard, {name}), i
        assert registry_rows(postgres_url) == before
        # Marking open writers when a lost shard's writer is among them (every one, or those of
        # a stale set of checkpoints owned): refused, none marked, shard 1's open writer neither.
        registry.write_batch(writers=[writer("hk2", kept)])
        for owns in (None, {kept, gone}.__contains__):
            with pytest.raises(RegistryFenced, match="no longer holds shard 2"):
                registry.mark_open_writers(WriterState.LOST, 3.0, owns=owns)
        assert registry.list_writers(gone)[0].state == WriterState.OPEN
        assert [w.state for w in registry.list_writers(kept) if w.handle == "hk2"] == [WriterState.OPEN]
        marked = registry.mark_open_writers(WriterState.LOST, 3.0, owns={kept}.__contains__)
        assert [w.handle for w in marked] == ["hk2"]


def test_the_registry_without_a_fence_writes_as_it_did(postgres_url: str, locks: list[StoreLock]) -> None:
    """A registry given no fence (SQLite, or one in another database than the store) is not fenced."""
    two = take(locks, postgres_url, "a", 2)
    gone = name_in(2, SHARDS, "g")
    take_over(locks, postgres_url, two)
    with SqlRegistry(postgres_url) as registry:
        seed(registry, gone, "hg")
        assert [w.handle for w in registry.list_writers(gone)] == ["hg"]


def test_a_coordinator_that_lost_a_shard_records_nothing_of_its_checkpoints_afterwards(
    tmp_path: Path, postgres_url: str, locks: list[StoreLock], caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator service (the registry in the store's database) whose shard 2 another coordinator
    took: its claims, cursors, failed attempts, writer rows and events of shard 2's checkpoints are
    refused or dropped, nothing of them written, before and after the shard leaves its fence; shard 1
    is recorded as before all along, even before the lost shard left the fence (the write-behind
    drops the lost shard's rows and writes the kept shard's in the same flush)."""
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=SHARDS)
    kept, gone = name_in(1, SHARDS, "k"), name_in(2, SHARDS, "g")
    settings = Settings(data_dir=tmp_path / "data", settle_ms=0, store=postgres_url)

    def in_shards(*shards: int) -> Callable[[str], bool]:
        return lambda name: shard_of(name, SHARDS) in shards

    def of(name: str, rows: dict[str, list[str]]) -> dict[str, list[str]]:
        return {table: [r for r in found if repr(name) in r] for table, found in rows.items()}

    async def refused(call: Any) -> None:
        with pytest.raises(Unavailable, match="no longer (owns|holds) shard 2"):
            await call

    async def main() -> None:
        service = build_service(settings, fence=fence, owns=in_shards(1, 2))
        core = service._core
        await service.start()
        try:
            wk = await service.open_writer(kept, writer_id="wk")
            wg = await service.open_writer(gone, writer_id="wg")
            for handle in (wk.handle, wg.handle):
                await service.apply_deltas(handle, tree("a"))
                await service.acquire(handle, ["c0"])
                await service.save_cursors(handle, [("c0", b"at 1")])
                await service.report_failure(handle, "f0", "first")
            await core.bookkeeping.flush()
            take_over(locks, postgres_url, two)  # paused past its lease: shard 2 taken over
            at_takeover = of(gone, registry_rows(postgres_url))
            # Shard 2 still in the fence (its loss not noticed yet): refused, nothing recorded.
            await refused(service.acquire(wg.handle, ["c1"]))
            await refused(service.save_cursors(wg.handle, [("c1", b"at 2")]))
            await refused(service.report_failure(wg.handle, "f1", "second"))
            # Shard 1's writes are fenced by shard 1's epoch alone: they pass meanwhile.
            assert (await service.acquire(wk.handle, ["c1"]))[0].token == 1
            await service.save_cursors(wk.handle, [("c1", b"at 2")])
            core.event(gone, EventKind.ANOMALY, "late event of the lost shard")
            core.event(kept, EventKind.ANOMALY, "event of the shard kept")
            await service.keep_alive(wg.handle)
            service._writers.queue_heartbeats()
            await core.bookkeeping.flush()  # the lost shard's rows dropped, the kept's written
            assert not core.bookkeeping.queued
            assert any("event of the shard kept" in r for r in registry_rows(postgres_url)["events"])
            mark = core.registry.mark_open_writers
            await refused(core.registry_write(mark, WriterState.LOST, 9.0, (), in_shards(1, 2)))
            # Dropped from the fence and the service, as serve_shards drops a lost shard.
            assert fence.remove(2) is two
            await service.lose(in_shards(2), owns=in_shards(1))
            # A late row of the lost shard (a call that was at work) is dropped; the rest written.
            core.bookkeeping.writer(writer(wg.handle, gone, WriterState.CLOSED))
            core.event(gone, EventKind.WRITER_CLOSED, "late close of the lost shard's writer")
            await core.bookkeeping.flush()
            assert not core.bookkeeping.queued
            assert (await service.acquire(wk.handle, ["c2"]))[0].token == 1
            # Marking writers for a stale set of checkpoints owned, the lost shard's among them.
            await refused(core.registry_write(mark, WriterState.LOST, 9.0, (), in_shards(1, 2)))
        finally:
            service.stop_accepting()
            await service.shutdown()
        assert of(gone, registry_rows(postgres_url)) == at_takeover

    with caplog.at_level(logging.WARNING, logger="tally_server.service.registry_writer"):
        asyncio.run(main())
    assert f"dropped the registry's rows of {gone} (" in caplog.text
    rows = registry_rows(postgres_url)
    assert any("event of the shard kept" in r for r in rows["events"])
    assert not any("lost shard" in r for r in rows["events"])
    with SqlRegistry(postgres_url) as registry:
        assert {w.writer_id: w.state for w in registry.list_writers(gone)} == {"wg": WriterState.OPEN}
        assert {(c.checkpoint, c.source_id) for c in registry.live_claims()} == {
            (kept, "c0"),
            (kept, "c1"),
            (kept, "c2"),
            (gone, "c0"),
        }


def test_the_registry_is_fenced_only_in_the_stores_database(
    tmp_path: Path, postgres_url: str, locks: list[StoreLock], caplog: pytest.LogCaptureFixture
) -> None:
    """Only a registry in the store's database can run the fence in its own transactions: one
    elsewhere (``--registry-url``) is not fenced, and the coordinator says so at start."""
    fence = ShardFence({1: take(locks, postgres_url, "a", 1)}, store_shards=SHARDS)
    elsewhere = f"sqlite:///{tmp_path / 'registry.sqlite3'}"
    # The store's database spelled otherwise (libpq's scheme, a connection option).
    spelled = store_url(postgres_url).set(drivername="postgresql", query={"connect_timeout": "5"})
    same = spelled.render_as_string(hide_password=False)
    for registry_url, fenced in ((None, True), (same, True), (elsewhere, False)):
        settings = Settings(data_dir=tmp_path / "data", store=postgres_url, registry_url=registry_url)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tally_server.app"):
            service = build_service(settings, fence=fence, owns=lambda name: shard_of(name, SHARDS) == 1)
        try:
            assert (service._core.registry.fence is fence) == fenced, registry_url  # type: ignore[attr-defined]
            assert ("is not in the store's database" in caplog.text) != fenced
        finally:
            asyncio.run(service.shutdown())


def test_on_a_store_of_one_shard_a_deposed_owners_registry_writes_are_refused(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """The store's lock is the fence of a store of one shard: once another coordinator took the
    store, every registry write of the deposed owner is refused and names every checkpoint it wrote."""
    lock = take(locks, postgres_url, "a", 0)
    with SqlRegistry(postgres_url, fence=lock) as registry:
        seed(registry, "cp/a", "ha")
        take_over(locks, postgres_url, lock)
        before = registry_rows(postgres_url)
        with pytest.raises(RegistryFenced, match="no longer owns the PostgreSQL store") as no:
            registry.write_batch(writers=[writer("ha", "cp/a", WriterState.CLOSED), writer("hb", "cp/b")])
        assert (no.value.shard, no.value.refused) == (None, {"cp/a", "cp/b"})
        for write in every_write(registry, "cp/a", "ha"):
            with pytest.raises(RegistryFenced):
                write()
        assert registry_rows(postgres_url) == before
