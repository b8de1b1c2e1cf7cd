"""Shards of a PostgreSQL store (``store.shards``): layout, per-shard locks and epochs, fencing by shard.

Against the real local PostgreSQL, a fresh database per test. Shard k is locked under advisory key
``STORE_LOCK_KEY + k`` with its epoch in ``store_epoch.id = k + 1``; shard 0 is the whole store's
lock and row of before shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command

from tally_server.domain.journal import Persisted
from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    DeleteCompleted,
    ForgetWriter,
    JournalEntry,
    JournalOp,
    OpenJournal,
    PutCompleted,
    checkpoints_of,
)
from tally_server.errors import Unavailable
from tally_server.service.committer import GroupCommitter
from tally_server.service.stats import ServiceStats
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.pg_journal import PgJournal
from tally_server.store.pg_revisions import REVISIONS
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import (
    READ_EPOCH,
    STORE_LOCK_KEY,
    Fenced,
    StoreInUse,
    StoreLock,
    StoreUnreachable,
    store_url,
)
from tally_server.store.replicas import ReplicaBoard
from tally_server.store.shards import (
    Fence,
    NoShardHeld,
    ShardFence,
    ShardNotHeld,
    StoreLayoutMismatch,
    prepare_layout,
    run_fence,
    shard_of,
)
from tests.pg_sessions import alter_database, end_sessions
from tests.unit.store.test_pg_store import who

pytestmark = pytest.mark.postgres


def rows(url: str, query: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(store_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(query))]
    finally:
        engine.dispose()


def epochs(url: str) -> dict[int, tuple[object, ...]]:
    """``store_epoch`` by shard: (epoch, holder)."""
    return {int(r[0]) - 1: r[1:] for r in rows(url, "SELECT id, epoch, holder FROM store_epoch ORDER BY id")}


def held_keys(url: str) -> set[int]:
    """The store lock keys granted in ``url``'s database, as shard numbers (key - STORE_LOCK_KEY)."""
    found = rows(
        url,
        "SELECT (l.classid::bigint << 32) + l.objid::bigint FROM pg_locks l WHERE l.locktype = 'advisory' "
        "AND l.granted AND l.objsubid = 1 "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return {int(key) - STORE_LOCK_KEY for (key,) in found if 0 <= int(key) - STORE_LOCK_KEY < 256}


def lock_session(lock: StoreLock) -> int:
    assert lock._conn is not None
    return int(lock._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def name_in(shard: int, shards: int, stem: str = "cp") -> str:
    """A checkpoint name of ``shard`` (of ``shards``)."""
    return next(f"{stem}/{i}" for i in range(10_000) if shard_of(f"{stem}/{i}", shards) == shard)


def take(locks: list[StoreLock], url: str, holder: str, shard: int, *, wait_s: float = 0) -> StoreLock:
    """``holder`` takes ``shard``'s lock (waiting ``wait_s`` for a holder going away), released by
    the ``locks`` fixture at the test's end."""
    lock = StoreLock(store_url(url), holder, shard=shard)
    lock.acquire(wait_s=wait_s)
    locks.append(lock)
    return lock


# ------------------------------------------------------------------ layout


def test_the_first_coordinator_fixes_the_shard_count_and_later_ones_must_agree(postgres_url: str) -> None:
    url = store_url(postgres_url)
    assert prepare_layout(url, 4) == 4
    assert prepare_layout(url, None) == 4  # without the option: the store's count
    assert prepare_layout(url, 4) == 4
    with pytest.raises(StoreLayoutMismatch) as refused:
        prepare_layout(url, 8)
    message = str(refused.value)
    assert "has 4 shards (fixed when it was made" in message and "not the 8 asked for" in message
    assert "--store-shards 4" in message and "without the option" in message
    assert rows(postgres_url, "SELECT id, shards FROM store_layout") == [(1, 4)]  # unchanged
    for wrong in (0, 257):
        with pytest.raises(ValueError, match="1 to 256 shards"):
            prepare_layout(url, wrong)


def test_a_store_without_a_count_gets_one_shard(postgres_url: str) -> None:
    assert prepare_layout(store_url(postgres_url), None) == 1
    assert rows(postgres_url, "SELECT shards FROM store_layout") == [(1,)]
    with pytest.raises(StoreLayoutMismatch, match="has 1 shard "):
        prepare_layout(store_url(postgres_url), 2)


def test_a_store_at_s0004_is_upgraded_and_its_published_statuses_get_their_shards(postgres_url: str) -> None:
    engine = sa.create_engine(store_url(postgres_url), poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        command.upgrade(REVISIONS.config(conn), "s0004")
        conn.commit()
    names = [name_in(0, 3), name_in(1, 3), name_in(2, 3)]
    with engine.begin() as conn:
        for name in names:
            conn.execute(
                sa.text(
                    "INSERT INTO checkpoint_status (checkpoint, status, epoch, published_at) "
                    "VALUES (:c, '{}', 1, 0)"
                ),
                {"c": name},
            )
    engine.dispose()
    assert prepare_layout(store_url(postgres_url), 3) == 3
    engine = sa.create_engine(store_url(postgres_url), poolclass=sa.pool.NullPool)
    assert REVISIONS.current(engine) == "s0005"
    got = dict(rows(postgres_url, "SELECT checkpoint, shard FROM checkpoint_status"))
    assert got == {names[0]: 0, names[1]: 1, names[2]: 2}
    # and down again, for a rollback to a Tally of before shards
    with engine.connect() as conn:
        command.downgrade(REVISIONS.config(conn), "s0004")
        conn.commit()
    assert "store_layout" not in sa.inspect(engine).get_table_names()
    assert "shard" not in {c["name"] for c in sa.inspect(engine).get_columns("checkpoint_status")}
    engine.dispose()


# ------------------------------------------------------------------ locks


def test_shard_zero_is_the_whole_stores_lock_and_row_of_before(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    lock = take(locks, postgres_url, "a", 0)
    assert held_keys(postgres_url) == {0}  # advisory key STORE_LOCK_KEY itself
    assert epochs(postgres_url) == {0: (1, "a")}  # store_epoch.id = 1
    assert lock.statement() == (READ_EPOCH, ())
    with pytest.raises(StoreInUse) as refused:
        StoreLock(store_url(postgres_url), "b").acquire(wait_s=0)
    assert str(refused.value).startswith("store ")  # named as before shards


def test_each_shard_is_locked_and_fenced_on_its_own(postgres_url: str, locks: list[StoreLock]) -> None:
    one = take(locks, postgres_url, "a", 1)
    two = take(locks, postgres_url, "b", 2)
    assert held_keys(postgres_url) == {1, 2}
    assert epochs(postgres_url) == {1: (1, "a"), 2: (1, "b")}  # no row for shard 0: never taken
    with pytest.raises(StoreInUse) as refused:
        StoreLock(store_url(postgres_url), "c", shard=1).acquire(wait_s=0)
    assert "shard 1 of store" in str(refused.value)
    two.release()
    assert held_keys(postgres_url) == {1}  # shard 1 of the same process stays held ...
    one.check()  # ... and renews on its session
    with pytest.raises(StoreInUse):
        StoreLock(store_url(postgres_url), "c", shard=1).acquire(wait_s=0)
    take(locks, postgres_url, "c", 2)  # shard 2 is free: its epoch moves on, shard 1's does not
    assert epochs(postgres_url) == {1: (1, "a"), 2: (2, "c")}
    with pytest.raises(ValueError, match="at most 256 shards"):
        StoreLock(store_url(postgres_url), "c", shard=256)


def test_a_lock_of_one_shard_fences_commits_as_the_stores_lock_did(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    lock = take(locks, postgres_url, "a", 3)
    assert isinstance(lock, Fence)
    with PgCompletionStore(postgres_url, lock) as store:
        store.commit([PutCompleted("cp/x", "w", ["a"])])
        end_sessions(postgres_url, [lock_session(lock)])  # its lock session ends (as a restart would)
        take(locks, postgres_url, "b", 3)  # and another coordinator takes shard 3 meanwhile
        with pytest.raises(Fenced, match="no longer owns shard 3 of the PostgreSQL store"):
            store.commit([PutCompleted("cp/x", "w", ["b"])])
        assert store.load("cp/x").completed == {"a"}


# ------------------------------------------------------------------ ShardFence


def completed_rows(url: str) -> int:
    return int(rows(url, "SELECT count(*) FROM completed")[0][0])


def test_a_shard_fence_lets_commits_through_until_another_coordinator_takes_one_of_its_shards(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two})
    assert fence.shards == {1, 2}
    store = PgCompletionStore(postgres_url, fence)
    journal = PgJournal(postgres_url, fence)
    try:
        store.commit([PutCompleted("cp/a", "w", ["a", "b"])])
        store.commit_group(journal, [OpenJournal(who("h1"))], [PutCompleted("cp/a", "w", ["c"])])
        assert completed_rows(postgres_url) == 3
        end_sessions(postgres_url, [lock_session(two)])  # shard 2's lock session ends ...
        take(locks, postgres_url, "b", 2)  # ... and another coordinator takes shard 2
        with pytest.raises(Fenced, match="no longer owns shard 2 of the PostgreSQL store") as fenced:
            store.commit([PutCompleted("cp/a", "w", ["d", "e"])])
        assert fenced.value.shard == 2
        with pytest.raises(Fenced):
            store.commit_group(journal, [OpenJournal(who("h2"))], [PutCompleted("cp/a", "w", ["f"])])
        with pytest.raises(Fenced):
            journal.commit([OpenJournal(who("h3"))])
        assert completed_rows(postgres_url) == 3  # nothing of the refused commits was written
        assert [w.opened.handle for w in journal.load()] == ["h1"]
        assert fence.remove(2) is two and fence.shards == {1}
        store.commit([PutCompleted("cp/a", "w", ["d"])])  # shard 1 alone: still ours
        assert completed_rows(postgres_url) == 4
    finally:
        journal.close()
        store.close()


def test_a_shard_fence_refuses_a_commit_carrying_a_checkpoint_of_a_shard_it_does_not_hold(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """Given the store's number of shards, the fence checks the shards of the checkpoints a commit
    carries (completions, journal entries and writers, a reset's move to the trash): one of a shard
    not read (never held, or removed: handed over) is refused, though every shard read is ours."""
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=4)
    ones, twos, threes = name_in(1, 4, "x"), name_in(2, 4, "y"), name_in(3, 4, "z")
    store = PgCompletionStore(postgres_url, fence)
    journal = PgJournal(postgres_url, fence)
    try:
        store.commit([PutCompleted(ones, "w", ["a"]), PutCompleted(twos, "w", ["a"])])
        with pytest.raises(ShardNotHeld, match=f"no longer holds shard 3 .*checkpoint '{threes}'") as refused:
            store.commit([PutCompleted(threes, "w", ["a"])])
        assert isinstance(refused.value, Fenced) and refused.value.shard == 3
        assert fence.remove(2) is two  # handed over: still ours in the store, no longer in the fence
        late_entry = JournalEntry("h2", 1, Persisted(["a"]), twos)
        refusals = [
            lambda: store.commit([PutCompleted(twos, "w", ["b"])]),
            lambda: store.commit([PutCompleted(ones, "w", ["b"]), DeleteCompleted(twos, ["a"])]),
            lambda: store.commit_group(journal, [late_entry], [PutCompleted(ones, "w", ["c"])]),
            lambda: store.commit_group(
                journal, [OpenJournal(dataclasses.replace(who("h3"), checkpoint=twos))], []
            ),
            lambda: journal.commit([ForgetWriter("h2", twos)]),
            lambda: store.trash(twos, "stamp"),
        ]
        for refusal in refusals:
            with pytest.raises(ShardNotHeld, match="no longer holds shard 2"):
                refusal()
        store.commit_group(
            journal, [JournalEntry("h1", 1, Persisted(["a"]), ones)], [PutCompleted(ones, "w", ["d"])]
        )
        assert sorted(
            rows(postgres_url, "SELECT checkpoint, convert_from(source_id, 'UTF8') FROM completed")
        ) == [
            (ones, "a"),
            (ones, "d"),
            (twos, "a"),
        ]
        assert rows(postgres_url, "SELECT handle FROM journal_entries") == [("h1",)]
    finally:
        journal.close()
        store.close()


def test_a_commit_is_fenced_by_the_shards_it_carries_not_by_every_shard_held(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """Shard 2 taken by another coordinator while still in the fence (this one paused past its lease,
    its loss not noticed yet): commits carrying only shard 1's checkpoints pass and are durable; one
    carrying a checkpoint of shard 2 is refused (naming shard 2's checkpoints alone), nothing of it
    written. A commit that carries nothing named, or rows of a checkpoint it cannot name, is still
    fenced by every shard held."""
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=4)
    ones, twos = name_in(1, 4, "x"), name_in(2, 4, "y")
    store, journal = PgCompletionStore(postgres_url, fence), PgJournal(postgres_url, fence)
    try:
        store.commit([PutCompleted(ones, "w", ["a"]), PutCompleted(twos, "w", ["a"])])
        journal.commit([opened("h1", ones), opened("h2", twos)])
        end_sessions(postgres_url, [lock_session(two)])  # paused past its lease ...
        take(locks, postgres_url, "b", 2)  # ... and another coordinator took shard 2
        assert fence.shards == {1, 2}  # not noticed yet
        store.commit([PutCompleted(ones, "w", ["b"]), DeleteCompleted(ones, ["a"])])
        store.commit_group(
            journal, [JournalEntry("h1", 1, Persisted(["b"]), ones)], [PutCompleted(ones, "w", ["c"])]
        )
        journal.commit([opened("h3", ones)])
        assert completed_ids(postgres_url) == [(ones, "b"), (ones, "c"), (twos, "a")]
        assert rows(postgres_url, "SELECT handle, idx FROM journal_entries") == [("h1", 1)]
        with psycopg_engine(postgres_url) as conn:
            assert run_fence(conn, fence, (ones,)) == {1: one.epoch}  # shard 1's epoch alone read
        refusals = [
            lambda: store.commit([PutCompleted(twos, "w", ["b"])]),
            lambda: store.commit([PutCompleted(ones, "w", ["d"]), DeleteCompleted(twos, ["a"])]),
            lambda: store.commit_group(
                journal, [JournalEntry("h2", 1, Persisted(["b"]), twos)], [PutCompleted(ones, "w", ["d"])]
            ),
            lambda: journal.commit([opened("h4", ones), ForgetWriter("h2", twos)]),
            lambda: store.trash(twos, "stamp"),
        ]
        for i, refusal in enumerate(refusals):
            with pytest.raises(Fenced, match="no longer owns shard 2 of the PostgreSQL store") as fenced:
                refusal()
            assert fenced.value.shard == 2 and fenced.value.refuses is not None, i
            assert fenced.value.refuses(twos) and not fenced.value.refuses(ones), i
            assert "this one drops it, so retry against the one that took over" in str(fenced.value), i
        # Rows of a checkpoint not named (a journal op that does not say its own): every shard held.
        unnamed = [
            lambda: journal.commit([opened("h5", ones), ForgetWriter("h1")]),
            lambda: store.commit_group(
                journal, [JournalEntry("h1", 2, Persisted(["e"]))], [PutCompleted(ones, "w", ["e"])]
            ),
        ]
        for refusal in unnamed:
            with pytest.raises(Fenced, match="no longer owns shard 2"):
                refusal()
        with psycopg_engine(postgres_url) as conn, pytest.raises(Fenced, match="no longer owns shard 2"):
            run_fence(conn, fence)  # carrying nothing: every shard held
        assert completed_ids(postgres_url) == [(ones, "b"), (ones, "c"), (twos, "a")]
        assert rows(postgres_url, "SELECT handle, idx FROM journal_entries") == [("h1", 1)]
        writers = rows(postgres_url, "SELECT handle FROM journal_writers ORDER BY handle")
        assert writers == [("h1",), ("h2",), ("h3",)]
    finally:
        journal.close()
        store.close()


@contextlib.contextmanager
def psycopg_engine(url: str) -> Iterator[sa.Connection]:
    """A connection to ``url``'s database in a transaction, rolled back at the end."""
    engine = sa.create_engine(store_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def test_a_commit_carrying_one_shard_holds_up_a_takeover_of_that_shard_until_it_ends(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """The read of the shards carried is FOR KEY SHARE on their rows, in the commit's transaction: the
    next taker of a shard carried waits for the commit; a shard held but not carried is not read."""
    alter_database(postgres_url, "SET lock_timeout = '1s'")
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=4)
    with psycopg_engine(postgres_url) as commit:
        assert run_fence(commit, fence, (name_in(1, 4),)) == {1: one.epoch}  # a commit in flight
        one.release()
        two.release()
        taker = StoreLock(store_url(postgres_url), "b", shard=1)
        with pytest.raises(StoreUnreachable, match="lock timeout"):
            taker.acquire(wait_s=0)  # the bump of shard 1 waits for the commit in flight
        take(locks, postgres_url, "b", 2)  # shard 2 was not read: its bump does not wait
        commit.commit()
    taker.acquire(wait_s=0)
    locks.append(taker)
    assert {k: v for k, v in epochs(postgres_url).items() if k in (1, 2)} == {1: (2, "b"), 2: (2, "b")}


def test_a_shard_fence_holding_nothing_lets_nothing_through(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    fence = ShardFence(url=store_url(postgres_url))
    with PgCompletionStore(postgres_url, fence) as store:
        with pytest.raises(NoShardHeld, match="holds no shard of the PostgreSQL store"):
            store.commit([PutCompleted("cp/a", "w", ["a"])])
        assert completed_rows(postgres_url) == 0
        fence.add(take(locks, postgres_url, "a", 5))
        store.commit([PutCompleted("cp/a", "w", ["a"])])
        assert completed_rows(postgres_url) == 1
    with pytest.raises(ValueError, match="acquire it before fencing"):
        fence.add(StoreLock(store_url(postgres_url), "a", shard=6))
    with pytest.raises(ValueError, match="another lock already"):
        fence.add(_other_lock_of(fence, 5))


def _other_lock_of(fence: ShardFence, shard: int) -> StoreLock:
    """A second lock object of a shard the fence holds (epoch copied: it never took the lock)."""
    other = StoreLock(fence.url, "a", shard=shard)
    held = fence.lock(shard)
    assert held is not None
    other.epoch = held.epoch
    return other


def test_a_shard_fences_read_holds_up_a_takeover_of_its_shards_until_the_commit_ends(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """The read is FOR KEY SHARE on each held shard's row: another coordinator's bump of one of them
    waits for the transaction that read it (here: gives up after a second)."""
    alter_database(postgres_url, "SET lock_timeout = '1s'")
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two})
    engine = sa.create_engine(store_url(postgres_url))
    try:
        with engine.connect() as commit:
            assert run_fence(commit, fence) == {1: one.epoch, 2: two.epoch}  # a commit in flight
            two.release()  # letting go does not wait for it (renewed_at alone)
            taker = StoreLock(store_url(postgres_url), "b", shard=2)
            with pytest.raises(StoreUnreachable, match="lock timeout"):
                taker.acquire(wait_s=0)  # the bump waits for the commit in flight
            assert epochs(postgres_url)[2] == (1, "a")
            commit.commit()
        taker.acquire(wait_s=0)
        locks.append(taker)
        assert epochs(postgres_url)[2] == (2, "b")
    finally:
        engine.dispose()


# ------------------------------------------------------------------ group commits over shards


def opened(handle: str, checkpoint: str) -> OpenJournal:
    return OpenJournal(dataclasses.replace(who(handle), checkpoint=checkpoint))


def completed_ids(url: str) -> list[tuple[object, ...]]:
    return sorted(rows(url, "SELECT checkpoint, convert_from(source_id, 'UTF8') FROM completed"))


class Recorded:
    """A group committer's joint commit on the store, recording the checkpoints each call carried.

    ``then(n)`` runs before the n-th call (from 1): what a race does between two commits.
    """

    def __init__(self, store: PgCompletionStore, journal: PgJournal) -> None:
        self.store, self.journal = store, journal
        self.carried: list[set[str]] = []
        self.before: dict[int, Any] = {}

    def __call__(self, entries: Sequence[JournalOp], changes: Sequence[CompletionOp]) -> CommitReport:
        self.carried.append(checkpoints_of([*entries, *changes]))
        if (then := self.before.get(len(self.carried))) is not None:
            then()
        return self.store.commit_group(self.journal, entries, changes)


async def answered_in_order(futures: Sequence[asyncio.Future[None]]) -> tuple[list[object], list[int]]:
    """Every future's outcome (None or the exception), and the order they were answered in."""
    order: list[int] = []
    for i, future in enumerate(futures):
        future.add_done_callback(lambda _, i=i: order.append(i))
    return list(await asyncio.gather(*futures, return_exceptions=True)), order


def is_shard_moved(outcome: object, shard: int) -> bool:
    return isinstance(outcome, Unavailable) and f"no longer holds shard {shard} of the PostgreSQL" in str(
        outcome
    )


@pytest.mark.parametrize("how", ["joint", "joint, failed up front", "two stages"])
def test_a_group_carrying_a_shard_not_held_commits_the_other_shards_ops_and_fails_only_its_own(
    postgres_url: str, locks: list[StoreLock], how: str
) -> None:
    """One group commit with ops of shards held and of a shard that left the fence (handed over or
    lost): the held shards' ops are durable and their submitters answered; the other shard's
    submitters get UNAVAILABLE (the shard moved: retry), and nothing of its ops is written, nor of
    ops sharing a future with one of them. Every submitter is answered in the order it queued (per
    stage, with two). Either the commit is refused for the shard and the rest committed again, or,
    given the fence's ``refusal``, the shard's ops are failed before any commit."""
    fence = ShardFence({k: take(locks, postgres_url, "a", k) for k in (1, 2, 3)}, store_shards=4)
    ones, twos, threes = name_in(1, 4, "x"), name_in(2, 4, "y"), name_in(3, 4, "z")
    store, journal = PgCompletionStore(postgres_url, fence), PgJournal(postgres_url, fence)
    joint = Recorded(store, journal)
    options: dict[str, Any] = {"not_held": fence.refusal} if "up front" in how else {}
    committer = GroupCommitter(
        store, journal, ServiceStats(), joint=joint if how.startswith("joint") else None, **options
    )
    ops: list[Any] = [
        opened("h1", ones),
        PutCompleted(ones, "w1", ["a"]),
        opened("h2", twos),
        opened("h3", threes),
        PutCompleted(twos, "w2", ["a"]),
        # One future for both: durable together or not at all.
        [JournalEntry("h3", 1, Persisted(["a"]), threes), JournalEntry("h2", 1, Persisted(["a"]), twos)],
        DeleteCompleted(twos, ["old"]),
        PutCompleted(threes, "w3", ["a"]),
        JournalEntry("h1", 1, Persisted(["a"]), ones),
    ]
    moved = {2, 4, 5, 6}

    async def main() -> tuple[list[object], list[int]]:
        committer.start()
        try:
            await committer.submit(PutCompleted(twos, "w2", ["old"]))  # while shard 2 was held
            assert fence.remove(2) is not None
            joint.carried.clear()
            # Queued together: one group.
            futures = [
                committer.enqueue_all(op) if isinstance(op, list) else committer.enqueue(op) for op in ops
            ]
            return await answered_in_order(futures)
        finally:
            await committer.close()

    try:
        outcomes, order = asyncio.run(main())
    finally:
        journal.close()
        store.close()
    assert [i for i, outcome in enumerate(outcomes) if outcome is not None] == sorted(moved)
    assert all(is_shard_moved(outcomes[i], 2) for i in moved), outcomes
    if how == "two stages":  # the journal's submitters first, then the completions'
        assert order == sorted(
            range(len(ops)), key=lambda i: isinstance(ops[i], PutCompleted | DeleteCompleted)
        )
    else:
        assert order == list(range(len(ops)))
    assert completed_ids(postgres_url) == sorted([(ones, "a"), (twos, "old"), (threes, "a")])
    assert rows(postgres_url, "SELECT handle FROM journal_writers ORDER BY handle") == [("h1",), ("h3",)]
    assert rows(postgres_url, "SELECT handle, idx FROM journal_entries") == [("h1", 1)]
    if how == "joint":  # refused for shard 2, then committed without its ops
        assert joint.carried == [{ones, twos, threes}, {ones, threes}]
    elif how.startswith("joint"):  # never sent
        assert joint.carried == [{ones, threes}]
    assert committer._stats.commit_failures == (0 if "up front" in how else 1)


@pytest.mark.parametrize("joint_commit", [True, False], ids=["joint", "two stages"])
def test_a_group_with_ops_of_a_shard_taken_over_commits_the_kept_shards_ops_and_fails_only_its_own(
    postgres_url: str, locks: list[StoreLock], joint_commit: bool
) -> None:
    """Shard 2 taken by another coordinator while still in the fence (its loss not noticed yet): a
    group with ops of shards 1 and 2 is refused for shard 2 alone (its epoch moved), then committed
    again without shard 2's ops: shard 1's are durable and their submitters answered, shard 2's
    submitters get UNAVAILABLE (the shard moved: retry) and nothing of their ops is written."""
    one, two = take(locks, postgres_url, "a", 1), take(locks, postgres_url, "a", 2)
    fence = ShardFence({1: one, 2: two}, store_shards=4)
    ones, twos = name_in(1, 4, "x"), name_in(2, 4, "y")
    store, journal = PgCompletionStore(postgres_url, fence), PgJournal(postgres_url, fence)
    joint = Recorded(store, journal)
    committer = GroupCommitter(store, journal, ServiceStats(), joint=joint if joint_commit else None)
    ops: list[Any] = [
        opened("h1", ones),
        opened("h2", twos),
        PutCompleted(ones, "w1", ["a"]),
        PutCompleted(twos, "w2", ["a"]),
        JournalEntry("h1", 1, Persisted(["a"]), ones),
        JournalEntry("h2", 1, Persisted(["a"]), twos),
    ]
    moved = {1, 3, 5}

    async def main() -> tuple[list[object], list[int]]:
        committer.start()
        try:
            end_sessions(postgres_url, [lock_session(two)])  # paused past its lease ...
            take(locks, postgres_url, "b", 2)  # ... and another coordinator took shard 2
            assert fence.shards == {1, 2}  # not noticed yet
            futures = [committer.enqueue(op) for op in ops]  # queued together: one group
            return await answered_in_order(futures)
        finally:
            await committer.close()

    try:
        outcomes, order = asyncio.run(main())
    finally:
        journal.close()
        store.close()
    assert [i for i, outcome in enumerate(outcomes) if outcome is not None] == sorted(moved)
    moved_on = "no longer owns shard 2 of the PostgreSQL"
    assert all(isinstance(outcomes[i], Unavailable) and moved_on in str(outcomes[i]) for i in moved), outcomes
    if joint_commit:
        assert order == list(range(len(ops)))
        assert joint.carried == [{ones, twos}, {ones}]  # refused for shard 2, then without its ops
    assert completed_ids(postgres_url) == [(ones, "a")]
    assert rows(postgres_url, "SELECT handle FROM journal_writers") == [("h1",)]
    assert rows(postgres_url, "SELECT handle, idx FROM journal_entries") == [("h1", 1)]
    assert committer._stats.commit_failures == 1


def test_a_group_refused_again_for_a_shard_lost_meanwhile_commits_what_is_left(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """A second shard leaves the fence between the refusal and the commit again: that one is refused
    too, and what is left of the group (the shard still held) is committed the third time."""
    fence = ShardFence({k: take(locks, postgres_url, "a", k) for k in (1, 2, 3)}, store_shards=4)
    ones, twos, threes = name_in(1, 4, "x"), name_in(2, 4, "y"), name_in(3, 4, "z")
    store, journal = PgCompletionStore(postgres_url, fence), PgJournal(postgres_url, fence)
    joint = Recorded(store, journal)
    joint.before[2] = lambda: fence.remove(3)  # lost while the first refusal was answered
    committer = GroupCommitter(store, journal, ServiceStats(), joint=joint)
    names = [twos, ones, threes]

    async def main() -> tuple[list[object], list[int]]:
        committer.start()
        try:
            assert fence.remove(2) is not None
            futures = [
                committer.enqueue(op)
                for name in names
                for op in (opened(name, name), PutCompleted(name, "w", ["a"]))
            ]
            return await answered_in_order(futures)
        finally:
            await committer.close()

    try:
        outcomes, order = asyncio.run(main())
    finally:
        journal.close()
        store.close()
    assert order == list(range(6))
    assert outcomes[2:4] == [None, None]
    assert all(is_shard_moved(o, 2) for o in outcomes[:2]) and all(is_shard_moved(o, 3) for o in outcomes[4:])
    assert joint.carried == [{ones, twos, threes}, {ones, threes}, {ones}]
    assert completed_ids(postgres_url) == [(ones, "a")]
    assert rows(postgres_url, "SELECT handle FROM journal_writers") == [(ones,)]
    assert committer._stats.commit_failures == 2


# ------------------------------------------------------------------ status and owners


def test_owners_of_different_shards_publish_and_drop_only_their_own_statuses(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    url = store_url(postgres_url)
    assert prepare_layout(url, 4) == 4
    mine, theirs = [name_in(1, 4, "a"), name_in(1, 4, "b")], [name_in(3, 4, "c")]
    a_board = StatusBoard(url, ShardFence({1: take(locks, postgres_url, "a", 1)}), shards=4)
    b_board = StatusBoard(url, take(locks, postgres_url, "b", 3), shards=4)
    reader = StatusBoard(url)
    try:
        assert a_board.publish({name: {"n": 1} for name in mine} | {theirs[0]: {"n": "not a's"}}, mine)
        assert b_board.publish({theirs[0]: {"n": 3}}, theirs)
        assert reader.statuses([*mine, *theirs]) == {
            mine[0]: {"n": 1},
            mine[1]: {"n": 1},
            theirs[0]: {"n": 3},
        }
        got = {
            r[0]: r[1:] for r in rows(postgres_url, "SELECT checkpoint, shard, epoch FROM checkpoint_status")
        }
        assert got == {mine[0]: (1, 1), mine[1]: (1, 1), theirs[0]: (3, 1)}
        assert b_board.publish({}, [])  # b knows none of its checkpoints any more ...
        assert sorted(reader.names()) == sorted(mine)  # ... and drops none of a's
        assert a_board.publish({}, [mine[0]])
        assert reader.names() == [mine[0]]
    finally:
        for board in (a_board, b_board, reader):
            board.close()


def test_a_board_whose_shard_was_taken_but_is_still_in_its_fence_publishes_and_drops_the_others(
    postgres_url: str, locks: list[StoreLock]
) -> None:
    """Shard 2 taken by another coordinator while still in this one's fence (paused past its lease,
    its loss not noticed yet): a publish of shards 1 and 2 writes shard 1's statuses and leaves
    shard 2's rows (the new holder's) as they are; a full publish (``keep``) drops the stale rows of
    the shards still held (3 too, though it publishes none of its checkpoints), none of shard 2."""
    url = store_url(postgres_url)
    assert prepare_layout(url, 4) == 4
    one, two, three = (take(locks, postgres_url, "a", k) for k in (1, 2, 3))
    fence = ShardFence({1: one, 2: two, 3: three}, store_shards=4)
    board = StatusBoard(url, fence, shards=4)
    ones, twos, threes = [name_in(1, 4, "x"), name_in(1, 4, "y")], name_in(2, 4, "z"), name_in(3, 4, "w")
    reader = StatusBoard(url)
    b_board: StatusBoard | None = None
    try:
        assert board.publish({ones[0]: "a", ones[1]: "a", twos: "a", threes: "a"}, [*ones, twos, threes])
        end_sessions(postgres_url, [lock_session(two)])  # paused past its lease ...
        b_two = take(locks, postgres_url, "b", 2)  # ... and another coordinator took shard 2
        b_board = StatusBoard(url, b_two, shards=4)
        b_new = name_in(2, 4, "v")
        assert b_board.publish({twos: "b", b_new: "b"})
        assert fence.shards == {1, 2, 3}  # not noticed yet

        assert board.publish({ones[0]: "a2", twos: "a2, stale"})
        published = {
            r[0]: r[1:] for r in rows(postgres_url, "SELECT checkpoint, status, epoch FROM checkpoint_status")
        }
        assert published == {
            ones[0]: ("a2", one.epoch),
            ones[1]: ("a", one.epoch),
            twos: ("b", b_two.epoch),
            b_new: ("b", b_two.epoch),
            threes: ("a", three.epoch),
        }
        assert not board.publish({twos: "a3, stale"})  # nothing of it may be written
        # A full publish: a knows ones[0] alone now; shard 2's rows are not its to drop.
        assert board.publish({ones[0]: "a4"}, [ones[0]])
        assert reader.statuses([*ones, twos, b_new, threes]) == {ones[0]: "a4", twos: "b", b_new: "b"}
    finally:
        for each in (board, reader, b_board):
            if each is not None:
                each.close()


def test_the_replica_board_names_each_shards_owner(postgres_url: str, locks: list[StoreLock]) -> None:
    url = store_url(postgres_url)
    boards = [ReplicaBoard(url, name, f"{name}:1", f"{name}:2") for name in ("a", "b", "c")]
    try:
        for board in boards:
            board.announce()
        take(locks, postgres_url, "a", 1)
        take(locks, postgres_url, "a", 2)
        take(locks, postgres_url, "b", 3)
        owners = boards[2].owners()
        assert {shard: (o.name, o.epoch, o.grpc_address, o.http_address) for shard, o in owners.items()} == {
            1: ("a", 1, "a:1", "a:2"),
            2: ("a", 1, "a:1", "a:2"),
            3: ("b", 1, "b:1", "b:2"),
        }
        assert all(o.alive for o in owners.values())
        assert boards[2].owner() is None  # shard 0 was never taken
        owner, replicas = boards[2].snapshot()
        assert owner is None
        assert [(r.name, r.owner, r.shards) for r in replicas] == [
            ("a", True, (1, 2)),
            ("b", True, (3,)),
            ("c", False, ()),
        ]
    finally:
        for board in boards:
            board.close()
