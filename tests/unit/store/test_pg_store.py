"""The PostgreSQL store against a real PostgreSQL: completions, journals, the store's lock, its URL."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import psycopg
import pytest
import sqlalchemy as sa

from tally_server.domain.compact import Hasher
from tally_server.domain.journal import Applied, Completing, Opened, Persisted, Snapshot
from tally_server.domain.ledger import ApplyCounts, LedgerState
from tally_server.domain.ports import (
    CompletionWriteError,
    DeleteCompleted,
    ForgetWriter,
    JournalEntry,
    OpenJournal,
    PutCompleted,
)
from tally_server.settings import Settings
from tally_server.store.journal import encode_entry, encode_opened
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.pg_journal import PgJournal
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import (
    READ_EPOCH,
    RENEW_EVERY_S,
    TAKE_OVER_AFTER_S,
    Fenced,
    StoreInUse,
    StoreLock,
    StoreTakenMeanwhile,
    StoreUnreachable,
    stale_connection,
    store_url,
)
from tally_server.store.replicas import ReplicaBoard, ReplicaNameInUse, check_name_free
from tests.conftest import POSTGRES_ADMIN_URL
from tests.pg_sessions import allow_connections, alter_database, end_sessions

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(registry_postgres_url: str) -> Iterator[PgCompletionStore]:
    with PgCompletionStore(registry_postgres_url) as completions:
        yield completions


def rows(url: str, query: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(query))]
    finally:
        engine.dispose()


def test_commit_applies_ops_in_order_in_one_transaction(store: PgCompletionStore) -> None:
    assert not store.exists("cp/a")
    store.commit(
        [
            PutCompleted("cp/a", "w1", ["a", "b", "c", "é"]),
            PutCompleted("cp/a", "w2", ["b", "d"]),
            PutCompleted("cp/other", "w1", ["a"]),
            DeleteCompleted("cp/a", ["b"]),  # from every origin of cp/a only
            PutCompleted("cp/a", "w2", ["b"]),  # a later put re-adds it to its own origin
        ]
    )
    store.commit([PutCompleted("cp/a", "w1", ["a"])])  # already there: no error, no duplicate
    assert store.exists("cp/a") and store.exists("cp/other") and not store.exists("cp")
    assert store.load("cp/a").completed == {"a", "b", "c", "d", "é"}
    assert store.load("cp/a").unreadable == []
    assert store.contains("cp/a", "w1", [b"a", b"b", "é".encode(), b"zz"]) == [True, False, True, False]
    assert store.contains("cp/a", "w2", [b"b", b"d", b"a"]) == [True, True, False]
    assert store.contains("cp/a", "nobody", [b"a"]) == [False]
    assert store.load("cp/other").completed == {"a"}


def test_ids_an_origin_holds_already_are_skipped_and_the_rest_of_the_commit_applies(
    store: PgCompletionStore, registry_postgres_url: str
) -> None:
    store.commit([PutCompleted("cp/d", "w1", ["a", "b"])])
    # COPY refuses "b" (held already) and "c" (twice in one commit): the commit runs again, skipping them.
    store.commit(
        [
            PutCompleted("cp/d", "w1", ["b", "c", "d"]),
            PutCompleted("cp/d", "w1", ["c"]),
            DeleteCompleted("cp/d", ["a"]),
            PutCompleted("cp/d", "w2", ["a"]),
        ]
    )
    assert rows(
        registry_postgres_url,
        "SELECT convert_from(source_id, 'UTF8'), origin FROM completed "
        "WHERE checkpoint = 'cp/d' ORDER BY 1, 2",
    ) == [("a", "w2"), ("b", "w1"), ("c", "w1"), ("d", "w1")]
    # Ids that COPY must escape come back byte for byte.
    odd = ["tab\tnew\nline\\", "quote'\"", "é\u2028", "\\N"]
    store.commit([PutCompleted("cp/odd\tname", "w\\1", odd)])
    assert store.load("cp/odd\tname").completed == set(odd)
    assert store.contains("cp/odd\tname", "w\\1", [i.encode() for i in odd]) == [True] * len(odd)


def test_a_connection_lost_in_the_middle_of_a_commit_is_a_transient_error_with_nothing_written(
    postgres_url: str,
) -> None:
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    cut = threading.Event()

    def fence(conn: sa.Connection) -> None:  # cuts this very connection once its transaction began
        if cut.is_set():
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            with admin.connect() as other:
                other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})

    with PgCompletionStore(postgres_url, fence) as store:
        store.commit([PutCompleted("cp/cut", "w", ["a"])])
        cut.set()
        with pytest.raises(CompletionWriteError, match="Tally retries by itself"):
            store.commit([PutCompleted("cp/cut", "w", ["b", "c"])])  # COPY's connection is gone
        cut.clear()
        assert store.load("cp/cut").completed == {"a"}
        store.commit([PutCompleted("cp/cut", "w", ["b", "c"])])  # a retry on a fresh connection
        assert store.load("cp/cut").completed == {"a", "b", "c"}
    admin.dispose()


def test_a_commit_on_a_pooled_connection_a_database_restart_cut_goes_through(postgres_url: str) -> None:
    """Commits skip the pool's ping: the fence finds the connection closed, and the commit runs again."""
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = sa.make_url(postgres_url).database
    with StoreLock(store_url(postgres_url)) as lock, PgCompletionStore(postgres_url, lock) as store:
        journal = PgJournal(postgres_url, lock.fence)
        store.commit_group(journal, [OpenJournal(who("a"))], [PutCompleted("cp/r", "w", ["a"])])
        with admin.connect() as conn:  # as a restart does: every session of the database ends
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
        store.commit_group(journal, [JournalEntry("a", 1, batch(1))], [PutCompleted("cp/r", "w", ["b"])])
        store.commit([PutCompleted("cp/r", "w", ["c"])])
        assert store.load("cp/r").completed == {"a", "b", "c"}
        assert journal.load()[0].entries == [batch(1)]
        journal.close()
    admin.dispose()


def test_a_restart_costs_commits_one_retry_however_many_connections_the_pool_held(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every pooled connection dies at once: the first commit to find one dead starts a new pool, so
    the next commits do not each find another one (and none fails)."""
    with StoreLock(store_url(postgres_url)) as lock, PgCompletionStore(postgres_url, lock) as store:
        engine = store._commit_engine
        held = [engine.connect() for _ in range(4)]  # four in the pool, as concurrent commits leave
        for conn in held:
            conn.close()
        store.commit([PutCompleted("cp/p", "w", ["a"])])
        assert end_sessions(postgres_url) >= 5  # the four, the lock's, and the store's reads
        with caplog.at_level("INFO", logger="tally_server.store.pg_completions"):
            for source in "bcdefg":
                store.commit([PutCompleted("cp/p", "w", [source])])
        assert sum("committing again" in r.getMessage() for r in caplog.records) == 1
        assert store.load("cp/p").completed == set("abcdefg")


def test_a_commit_whose_rollback_failed_on_a_connection_the_server_ended_runs_again() -> None:
    """What a commit raised once in ten runs of ``test_pg_reconnect`` (the cut landing while its
    pipeline's results were due), rebuilt as psycopg and SQLAlchemy chained it: the pipeline read the
    server's FATAL, could not leave pipeline mode, and SQLAlchemy's ROLLBACK on it failed too, as no
    disconnect. The commit must take that for a connection the restart cut and run again."""

    def raised() -> BaseException:
        try:
            try:
                try:
                    raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")
                except psycopg.Error:
                    raise psycopg.OperationalError("cannot exit pipeline mode while busy")  # noqa: B904
            except psycopg.Error:
                try:
                    raise psycopg.OperationalError("sending query failed: cannot exit pipeline mode")
                except psycopg.Error as rollback:
                    raise sa.exc.OperationalError("ROLLBACK", None, rollback) from rollback
        except sa.exc.OperationalError as exc:
            return exc
        raise AssertionError("unreachable")

    seen = raised()
    assert not getattr(seen, "connection_invalidated", False)  # SQLAlchemy did not call it a disconnect
    assert stale_connection(seen)
    try:  # a connection that cannot be made at all is no stale one: no second try (as long again)
        raise sa.exc.OperationalError("connect", None, psycopg.OperationalError("connection refused"))
    except sa.exc.OperationalError as refused:
        assert not stale_connection(refused)


def test_status_and_replica_rows_are_written_though_the_session_ends_after_the_pools_ping(
    postgres_url: str,
) -> None:
    """The pool's ping passed, then the session ended (a restart ends them all within milliseconds):
    publishing statuses and renewing a replica's row run once more on a new connection."""
    url = store_url(postgres_url)
    lock = StoreLock(url, "r1")
    board, replicas = StatusBoard(url, lock), ReplicaBoard(url, "r1", "h:1", "h:2")
    cut: list[int] = []

    def end_this_session_once(conn: sa.Connection, *_: object) -> None:
        if not cut:
            cut.append(conn.connection.driver_connection.info.backend_pid)  # type: ignore[union-attr]
            end_sessions(postgres_url, cut)

    try:
        with lock:  # epoch 1, held by "r1"
            for engine in (board._engine, replicas._engine):
                cut.clear()
                with engine.connect():  # a pooled connection, pinged before its next use
                    pass
                sa.event.listen(engine, "before_cursor_execute", end_this_session_once)
            cut.clear()
            assert board.publish({"cp/s": {"name": "cp/s"}}) is True
            assert cut  # its first try's session was ended
            cut.clear()
            replicas.announce()
            assert cut
            cut.clear()
            owner = replicas.owner()
            assert cut and owner is not None and (owner.name, owner.grpc_address) == ("r1", "h:1")
        assert board.statuses(["cp/s"]) == {"cp/s": {"name": "cp/s"}}
    finally:
        board.close()
        replicas.close()


def test_the_lock_taken_again_after_its_session_ended_keeps_the_epoch(postgres_url: str) -> None:
    """A restart ends the lock's session; no one took the store meanwhile, so the same epoch goes on:
    commits that read it (in flight while the lock is taken again) are not fenced by their own owner."""
    url = store_url(postgres_url)
    with StoreLock(url) as lock, PgCompletionStore(postgres_url, lock) as store:
        store.commit([PutCompleted("cp/k", "w", ["a"])])
        epoch = lock.epoch
        assert lock._conn is not None
        pid = lock._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert end_sessions(postgres_url, [pid]) == 1
        store.commit([PutCompleted("cp/k", "w", ["b"])])  # the store is still ours: no one took it
        lock.check()  # finds its session ended and takes the lock again
        assert lock._conn is not None
        assert lock._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != pid
        assert lock.epoch == epoch
        assert rows(postgres_url, "SELECT epoch FROM store_epoch") == [(epoch,)]
        store.commit([PutCompleted("cp/k", "w", ["c"])])
        assert store.load("cp/k").completed == {"a", "b", "c"}


def test_a_coordinator_whose_store_was_taken_while_its_lock_session_was_gone_stops(
    postgres_url: str,
) -> None:
    """Another coordinator took the store and let it go while this one's session was gone: the lock is
    free again, but what this one holds in memory may be stale (a reset there, say), so it must stop."""
    url = store_url(postgres_url)
    with StoreLock(url) as lock, PgCompletionStore(postgres_url, lock) as store:
        assert lock._conn is not None
        pid = lock._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert end_sessions(postgres_url, [pid]) == 1
        with StoreLock(url) as other:  # took the store, and let it go
            assert other.epoch == (lock.epoch or 0) + 1
        with pytest.raises(StoreTakenMeanwhile, match="served by another coordinator") as refused:
            lock.check()
        assert isinstance(refused.value, StoreInUse)  # what makes the store's keeper stop this one
        assert f"the store's epoch is {other.epoch}, this one's was {lock.epoch}" in str(refused.value)
        with pytest.raises(Fenced):
            store.commit([PutCompleted("cp/t", "w", ["a"])])
        # It let the lock go again: a coordinator started anew takes the store.
        with StoreLock(url) as anew:
            assert anew.epoch == (other.epoch or 0) + 1


@pytest.mark.parametrize("shard", [0, 3])
def test_a_lock_whose_epoch_moved_under_its_live_session_is_lost_and_let_go(
    postgres_url: str, shard: int
) -> None:
    """The renewal finds the epoch changed though the lock's session never ended (an operator's
    UPDATE, or a coordinator bumping it without the lock): the store is lost, as when taken while
    the session was gone; the lock is let go, so a coordinator started anew takes the store."""
    url = store_url(postgres_url)
    with StoreLock(url, shard=shard) as lock:
        lock.check()  # renews
        pid = lock_session(lock)
        operator = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with operator.begin() as conn:  # an operator's change of the epoch, the lock held
                bumped = conn.execute(
                    sa.text("UPDATE store_epoch SET epoch = epoch + 1 WHERE id = :id"), {"id": shard + 1}
                )
                assert bumped.rowcount == 1
        finally:
            operator.dispose()
        with pytest.raises(
            StoreTakenMeanwhile, match="moved on while this coordinator held its lock"
        ) as lost:
            lock.check()
        assert isinstance(lost.value, StoreInUse)  # what the store's and the shard keeper's checks stop on
        assert f"the store's epoch is {(lock.epoch or 0) + 1}, this one's was {lock.epoch}" in str(lost.value)
        assert "find out who changed the epoch" in str(lost.value)
        assert ("shard 3 of" in str(lost.value)) == (shard == 3)
        assert rows(postgres_url, f"SELECT 1 FROM pg_stat_activity WHERE pid = {pid}") == []
        with StoreLock(url, shard=shard) as anew:
            assert anew.epoch == (lock.epoch or 0) + 2


def wait_for_locks_at_most(url: str, timeout: str) -> None:
    """Every new session of ``url``'s database gives up waiting for a lock after ``timeout``."""
    alter_database(url, f"SET lock_timeout = '{timeout}'")


def lock_session(lock: StoreLock) -> int:
    assert lock._conn is not None
    return int(lock._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def test_the_holders_renewal_never_waits_for_a_commit_in_flight(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit's transaction that has read the epoch (READ_EPOCH, its first statement) and is still
    open does not hold up the holder's renewal: with FOR SHARE it did, for as long as the commit
    took. Every session here gives up on a lock after a second."""
    wait_for_locks_at_most(postgres_url, "1s")
    url = store_url(postgres_url)
    engine = sa.create_engine(url)
    with StoreLock(url) as lock, PgCompletionStore(postgres_url, lock) as store, engine.connect() as commit:
        took: list[float] = []
        lock.renew_observers.append(took.append)
        pid = lock_session(lock)
        before = rows(postgres_url, "SELECT renewed_at FROM store_epoch")
        assert commit.execute(sa.text(READ_EPOCH)).scalar() == lock.epoch  # a commit in flight
        with caplog.at_level(logging.DEBUG, logger="tally_server.store.postgres"):
            lock.check()  # renews at once (FOR SHARE: a lock timeout, then StoreUnreachable)
        assert len(took) == 1 and took[0] < 0.5
        assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert lock_session(lock) == pid  # the same session: the renewal did not fail
        assert rows(postgres_url, "SELECT renewed_at FROM store_epoch") > before
        store.commit([PutCompleted("cp/r", "w", ["b"])])  # other commits go on beside it
        commit.execute(sa.text("INSERT INTO completed VALUES ('cp/r', 'a', 'w')"))
        commit.commit()
        assert store.load("cp/r").completed == {"a", "b"}
    engine.dispose()


def test_a_takeover_still_waits_for_every_commit_in_flight_and_fences_the_next(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The epoch is a key (revision s0004): its bump waits for commits that read it FOR KEY SHARE,
    though the renewal and the letting go (updates of the same row) went through meanwhile; once the
    commit in flight ends, the bump goes on and the deposed holder's next commit is fenced."""
    wait_for_locks_at_most(postgres_url, "1s")
    url = store_url(postgres_url)
    engine = sa.create_engine(url)
    first = StoreLock(url)
    first.acquire()
    store = PgCompletionStore(postgres_url, first)
    with engine.connect() as commit, caplog.at_level(logging.WARNING, logger="tally_server.store.postgres"):
        assert commit.execute(sa.text(READ_EPOCH)).scalar() == first.epoch  # a commit in flight ...
        commit.execute(sa.text("INSERT INTO completed VALUES ('cp/t', 'a', 'w')"))  # ... and its write
        first.check()  # renewed (a new version of the row) ...
        first.release()  # ... and let go (another) without waiting for it
        assert caplog.records == []
        assert rows(postgres_url, "SELECT epoch, renewed_at FROM store_epoch") == [(first.epoch, 0)]
        second = StoreLock(url)
        with pytest.raises(StoreUnreachable, match="lock timeout"):
            second.acquire()  # the bump waits for the commit in flight (here: gives up after 1 s)
        assert rows(postgres_url, "SELECT epoch FROM store_epoch") == [(first.epoch,)]
        commit.commit()  # the commit in flight ends, under the epoch it read
    second.acquire()  # and the bump goes on
    try:
        assert first.epoch is not None and second.epoch == first.epoch + 1
        with pytest.raises(Fenced, match=f"its epoch is {first.epoch}, the store's is {second.epoch}"):
            store.commit([PutCompleted("cp/t", "w", ["b"])])
        assert store.load("cp/t").completed == {"a"}
    finally:
        second.release()
        store.close()
        engine.dispose()


def test_a_database_made_before_keeps_working_without_its_second_index(postgres_url: str) -> None:
    with PgCompletionStore(postgres_url):
        pass
    index = "CREATE INDEX ix_completed_origin ON completed (checkpoint, origin)"
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(index))
    engine.dispose()
    with PgCompletionStore(postgres_url) as store:  # dropped at start: it only slowed commits
        store.commit([PutCompleted("cp/old", "w", ["a"])])
    indexes = rows(postgres_url, "SELECT indexname FROM pg_indexes WHERE tablename = 'completed'")
    assert indexes == [("completed_pkey",)]
    journal = PgJournal(postgres_url)
    journal.commit([OpenJournal(who("a")), JournalEntry("a", 1, batch(1))])
    journal.close()
    compression = rows(
        postgres_url,
        "SELECT attcompression::text FROM pg_attribute "
        "WHERE attrelid = 'journal_entries'::regclass AND attname = 'entry'",
    )
    assert compression == [("l",)]  # lz4 (this server has it): cheaper to write than pglz


def test_a_busy_table_keeps_its_old_index_until_a_later_start(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with PgCompletionStore(postgres_url):
        pass
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE INDEX ix_completed_origin ON completed (checkpoint, origin)"))
    with engine.connect() as backup:  # a reader holding the tables' locks, as pg_dump does
        backup.execute(sa.text("SELECT count(*) FROM completed, journal_entries")).scalar()
        with PgCompletionStore(postgres_url) as store:  # starts anyway, after the lock's timeout
            store.commit([PutCompleted("cp/busy", "w", ["a"])])
        journal = PgJournal(postgres_url)
        journal.commit([OpenJournal(who("a")), JournalEntry("a", 1, batch(1))])
        journal.close()
        backup.rollback()
    engine.dispose()
    assert "is no longer needed and slows commits down" in caplog.text
    assert "journal entries stay compressed with pglz" in caplog.text
    assert len(rows(postgres_url, "SELECT indexname FROM pg_indexes WHERE tablename = 'completed'")) == 2


def test_load_index_gives_each_origins_sorted_hashes(store: PgCompletionStore) -> None:
    hasher = Hasher()
    store.commit(
        [PutCompleted("cp/i", "w1", [f"s{i}" for i in range(100)]), PutCompleted("cp/i", "w2", ["s1"])]
    )
    loaded = store.load_index("cp/i", hasher)
    assert loaded.origins == ["w1", "w2"]
    assert loaded.unreadable == []
    expected = np.sort(hasher.of_keys([f"s{i}".encode() for i in range(100)]))
    assert np.array_equal(loaded.hashes[0], expected)
    assert np.array_equal(loaded.hashes[1], hasher.of_keys([b"s1"]))
    assert store.load_index("cp/none", hasher).origins == []
    shared = store.keys_matching("cp/i", ["w1", "w2"], lambda k: k == b"s1")
    assert shared == [b"s1", b"s1"]  # once per origin holding it, as per file on LMDB


def test_keys_after_pages_distinct_ids_in_byte_order(store: PgCompletionStore) -> None:
    ids = [f"k{i:03d}" for i in range(10)]
    store.commit(
        [
            PutCompleted("cp/p", "w1", ids[::2]),
            PutCompleted("cp/p", "w2", ids),
            PutCompleted("cp/p", "w3", ["z"]),
        ]
    )
    keys, last = store.keys_after("cp/p", ["w1", "w2"], b"", 4)
    assert (keys, last) == ([i.encode() for i in ids[:4]], False)
    keys, last = store.keys_after("cp/p", ["w1", "w2"], keys[-1], 100)
    assert (keys, last) == ([i.encode() for i in ids[4:]], True)
    assert store.keys_after("cp/p", ["w1", "w2"], b"k009", 5) == ([], True)
    # Bytewise order, whatever the database's collation: "B" (0x42) before "a" (0x61) before "é".
    store.commit([PutCompleted("cp/order", "w", ["a", "é", "B"])])
    assert store.keys_after("cp/order", ["w"], b"", 10)[0] == [b"B", b"a", "é".encode()]


def test_trash_moves_rows_never_deletes_them(store: PgCompletionStore, registry_postgres_url: str) -> None:
    store.commit([PutCompleted("cp/t", "w1", ["a", "b"]), PutCompleted("cp/t", "w2", ["c"])])
    store.commit([PutCompleted("cp/keep", "w1", ["a"])])
    moved_to, origins = store.trash("cp/t", "20261201T000000Z-abc")
    assert origins == 2 and "completed_trash" in moved_to and "20261201T000000Z-abc" in moved_to
    assert not store.exists("cp/t")
    assert store.load("cp/t").completed == set()
    assert store.load("cp/keep").completed == {"a"}
    trashed = rows(
        registry_postgres_url,
        "SELECT checkpoint, stamp, convert_from(source_id, 'UTF8'), origin FROM completed_trash ORDER BY 3",
    )
    assert trashed == [
        ("cp/t", "20261201T000000Z-abc", "a", "w1"),
        ("cp/t", "20261201T000000Z-abc", "b", "w1"),
        ("cp/t", "20261201T000000Z-abc", "c", "w2"),
    ]
    assert store.trash("cp/t", "again") == ("", 0)  # nothing left to move
    # The checkpoint starts over; a second reset keeps both generations apart by stamp.
    store.commit([PutCompleted("cp/t", "w1", ["a"])])
    assert store.exists("cp/t")
    assert store.trash("cp/t", "second")[1] == 1
    assert rows(registry_postgres_url, "SELECT count(*) FROM completed_trash")[0][0] == 4


def test_names_and_ids_the_store_cannot_hold_are_refused_before_any_write(store: PgCompletionStore) -> None:
    with pytest.raises(ValueError, match="511"):
        store.commit([PutCompleted("cp/v", "w", ["ok"]), PutCompleted("cp/v", "w", ["x" * 512])])
    with pytest.raises(ValueError, match="NUL|text"):
        store.commit([PutCompleted("cp/v", "w", ["ok"]), PutCompleted("cp/v", "w\x00", ["a"])])
    assert not store.exists("cp/v")
    assert store.load("cp/v").completed == set()


def test_an_unreachable_database_is_a_transient_write_error_and_a_retry_succeeds(postgres_url: str) -> None:
    name = sa.make_url(postgres_url).database
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with PgCompletionStore(postgres_url) as store:
        store.commit([PutCompleted("cp/f", "w", ["a"])])
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                {"n": name},
            )
        try:
            with pytest.raises(CompletionWriteError) as refused:
                store.commit([PutCompleted("cp/f", "w", ["b"])])
            assert "Tally retries by itself" in str(refused.value)
            assert not refused.value.disk_full
            with pytest.raises(CompletionWriteError):
                store.probe()
            # Reads say UNAVAILABLE; lookups answer "not completed" (a replay, never a false completion).
            from tally_server.errors import Unavailable

            with pytest.raises(Unavailable, match="retry"):
                store.load("cp/f")
            assert store.contains("cp/f", "w", [b"a"]) == [False]
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        store.probe()
        store.commit([PutCompleted("cp/f", "w", ["b"])])
        assert store.load("cp/f").completed == {"a", "b"}
    admin.dispose()


def who(handle: str) -> Opened:
    return Opened(handle, "cp/x", f"writer-{handle}", "host", 7, {"slurm": "3"}, {"input": "h"}, 1.5, "tok")


def batch(seq: int) -> Applied:
    return Applied(seq, [(f"t{seq}", "s", 1), (f"u{seq}", "é-src", -1)], ["hit"] if seq == 2 else [])


def snapshot(seq: int) -> Snapshot:
    state = LedgerState({"s": 1}, {"t1": 1}, {"done"}, set(), [], ApplyCounts(applied=seq))
    return Snapshot(state, seq, ApplyCounts(applied=1), ["done"])


def test_journal_entries_come_back_in_order_and_snapshots_drop_what_came_before(
    registry_postgres_url: str,
) -> None:
    journal = PgJournal(registry_postgres_url)
    journal.commit([OpenJournal(who("a")), OpenJournal(who("b"))])
    journal.commit([JournalEntry("a", i, batch(i)) for i in range(1, 12)])  # 10 and 11 sort after 9
    journal.commit([JournalEntry("b", 1, Completing(["s"])), JournalEntry("a", 12, Persisted(["s"]))])
    assert journal.entries() == 13
    assert journal.size_bytes() > 0
    journal.close()

    journal = PgJournal(registry_postgres_url)  # a restart
    loaded = {w.opened.handle: w for w in journal.load()}
    assert loaded["a"].opened == who("a")
    assert loaded["a"].entries == [*(batch(i) for i in range(1, 12)), Persisted(["s"])]
    assert loaded["a"].last_index == 12
    assert loaded["b"].entries == [Completing(["s"])]

    # One commit: entries before a snapshot, the snapshot, entries after it; then forget b.
    journal.commit(
        [
            JournalEntry("a", 13, batch(13)),
            JournalEntry("a", 14, snapshot(14)),
            JournalEntry("a", 15, batch(15)),
            ForgetWriter("b"),
        ]
    )
    loaded = {w.opened.handle: w for w in journal.load()}
    assert list(loaded) == ["a"]
    assert loaded["a"].entries == [snapshot(14), batch(15)]
    assert loaded["a"].last_index == 15
    assert journal.entries() == 2
    # The same bytes as the LMDB journal keeps.
    stored = rows(registry_postgres_url, "SELECT entry FROM journal_entries WHERE idx = 15")
    assert bytes(stored[0][0]) == encode_entry(batch(15))
    journal.close()


def test_journal_load_with_owns_brings_back_only_the_owned_checkpoints_writers(
    registry_postgres_url: str,
) -> None:
    """Found from the journal's own rows: no registry row is needed (none is written here)."""
    journal = PgJournal(registry_postgres_url)
    try:
        journal.commit([OpenJournal(replace(who(h), checkpoint=cp)) for h, cp in WHERE.items()])
        journal.commit([JournalEntry(h, 1, batch(i)) for i, h in enumerate(WHERE, 1)])
        # Rows of a Tally of before the checkpoint column: decoded to tell.
        engine = sa.create_engine(registry_postgres_url)
        with engine.begin() as conn:
            for handle, cp in (("old-a", "a/3"), ("old-b", "b/2")):
                conn.execute(
                    sa.text("INSERT INTO journal_writers (handle, opened) VALUES (:h, :o)"),
                    {"h": handle, "o": encode_opened(replace(who(handle), checkpoint=cp))},
                )
        engine.dispose()
        asked: list[str] = []

        def owns(name: str) -> bool:
            asked.append(name)
            return name.startswith("a/")

        mine = journal.load(owns)
        assert [(w.opened.handle, w.opened.checkpoint) for w in mine] == [
            ("a1", "a/1"),
            ("a2", "a/1"),
            ("a3", "a/2"),
            ("old-a", "a/3"),
        ]
        assert [w.entries for w in mine] == [[batch(1)], [batch(2)], [batch(3)], []]
        assert [w.last_index for w in mine] == [1, 1, 1, 0]
        # Each checkpoint the column names is asked about once; the legacy rows' after decoding.
        assert sorted(asked) == ["a/1", "a/2", "a/3", "b/1", "b/2"]
        assert [w.opened.handle for w in journal.load(lambda name: False)] == []
        assert [w.opened.handle for w in journal.load(owns, checkpoints=["a/2", "b/1"])] == ["a3"]
        assert {w.opened.handle for w in journal.load()} == {*WHERE, "old-a", "old-b"}
    finally:
        journal.close()


# Journaled writers by handle, and their checkpoints.
WHERE = {"a1": "a/1", "a2": "a/1", "a3": "a/2", "b1": "b/1"}


def _refuse_on_insert(url: str, table: str, condition: str) -> None:
    """A trigger making an insert into ``table`` fail as a full disk would, where ``condition`` holds."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "RAISE EXCEPTION 'no space left on device' USING ERRCODE = 'disk_full'; END $$"
                )
            )
            conn.execute(
                sa.text(
                    f"CREATE TRIGGER refuse BEFORE INSERT ON {table} FOR EACH ROW "
                    f"WHEN ({condition}) EXECUTE FUNCTION refuse()"
                )
            )
    finally:
        engine.dispose()


def test_a_group_commit_writes_journal_entries_and_completions_in_one_transaction(
    registry_postgres_url: str,
) -> None:
    url = store_url(registry_postgres_url)
    with StoreLock(url) as lock:
        journal = PgJournal(registry_postgres_url, lock.fence)
        store = PgCompletionStore(registry_postgres_url, lock)  # its epoch read goes with the writes
        store.commit_group(journal, [OpenJournal(who("a"))], [])  # journal ops alone
        store.commit_group(
            journal,
            [JournalEntry("a", 1, batch(1)), JournalEntry("a", 2, Completing(["s", "t"]))],
            [PutCompleted("cp/j", "w1", ["s", "t"])],
        )
        store.commit_group(journal, [], [PutCompleted("cp/j", "w1", ["u"])])  # completions alone
        # An id held already: the group runs again, skipping it; the journal entry is written once.
        store.commit_group(
            journal, [JournalEntry("a", 3, Persisted(["s"]))], [PutCompleted("cp/j", "w1", ["s", "v"])]
        )
        assert store.load("cp/j").completed == {"s", "t", "u", "v"}
        (loaded,) = journal.load()
        assert loaded.entries == [batch(1), Completing(["s", "t"]), Persisted(["s"])]
        journal.close()
        store.close()


def test_a_group_whose_completions_fail_leaves_no_journal_entry_and_the_other_way_round(
    registry_postgres_url: str,
) -> None:
    journal = PgJournal(registry_postgres_url)
    store = PgCompletionStore(registry_postgres_url)
    store.commit_group(journal, [OpenJournal(who("a"))], [PutCompleted("cp/k", "w1", ["a"])])
    _refuse_on_insert(registry_postgres_url, "completed", "NEW.source_id = 'boom'::bytea")
    with pytest.raises(CompletionWriteError, match="disk of the PostgreSQL store .* is full") as failed:
        store.commit_group(
            journal,
            [JournalEntry("a", 1, batch(1)), JournalEntry("a", 2, Completing(["b", "boom"]))],
            [PutCompleted("cp/k", "w1", ["b", "boom"])],
        )
    assert failed.value.disk_full
    (loaded,) = journal.load()
    assert loaded.entries == []  # the completions failed: their journal entries are not durable either
    assert store.load("cp/k").completed == {"a"}

    # The journal fails: nothing of the group's completions is written (the completions are
    # written after the journal's entries, in the same transaction).
    engine = sa.create_engine(registry_postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER refuse ON completed"))
        conn.execute(
            sa.text(
                "CREATE TRIGGER refuse BEFORE INSERT ON journal_entries FOR EACH ROW "
                "WHEN (NEW.idx = 5) EXECUTE FUNCTION refuse()"
            )
        )
    engine.dispose()
    with pytest.raises(CompletionWriteError, match="journal and completions"):
        store.commit_group(journal, [JournalEntry("a", 5, batch(5))], [PutCompleted("cp/k", "w1", ["c"])])
    assert store.load("cp/k").completed == {"a"}
    assert journal.load()[0].entries == []
    store.commit_group(journal, [JournalEntry("a", 6, batch(6))], [PutCompleted("cp/k", "w1", ["c"])])
    assert store.load("cp/k").completed == {"a", "c"}
    assert journal.load()[0].entries == [batch(6)]
    journal.close()
    store.close()


def test_a_deposed_coordinator_writes_neither_journal_entries_nor_completions_of_a_group(
    postgres_url: str,
) -> None:
    url = store_url(postgres_url)
    first = StoreLock(url)
    first.acquire()
    journal, store = PgJournal(postgres_url, first.fence), PgCompletionStore(postgres_url, first)
    store.commit_group(journal, [OpenJournal(who("a"))], [PutCompleted("cp/g", "w1", ["a"])])
    first.release()
    with StoreLock(url):
        with pytest.raises(Fenced):
            store.commit_group(journal, [JournalEntry("a", 1, batch(1))], [PutCompleted("cp/g", "w1", ["b"])])
        assert store.load("cp/g").completed == {"a"}
        assert journal.load()[0].entries == []
    journal.close()
    store.close()


def test_a_fenced_group_is_rolled_back_before_its_connection_serves_the_next_commit(
    postgres_url: str,
) -> None:
    """A commit sends its own BEGIN: one refused after its writes went through leaves an open
    transaction, which must be rolled back (not joined by the next commit on that connection)."""
    with StoreLock(store_url(postgres_url)) as lock, PgCompletionStore(postgres_url, lock) as store:
        journal = PgJournal(postgres_url, lock.fence)
        store.commit_group(journal, [OpenJournal(who("a"))], [PutCompleted("cp/b", "w1", ["a"])])
        assert lock.epoch is not None
        ours, lock.epoch = lock.epoch, lock.epoch + 1  # as if another coordinator had the store
        with pytest.raises(Fenced):
            store.commit_group(journal, [JournalEntry("a", 1, batch(1))], [PutCompleted("cp/b", "w2", ["b"])])
        lock.epoch = ours
        store.commit_group(journal, [JournalEntry("a", 1, batch(2))], [PutCompleted("cp/b", "w1", ["c"])])
        assert store.load("cp/b").completed == {"a", "c"}
        assert store.contains("cp/b", "w2", [b"b"]) == [False]
        assert journal.load()[0].entries == [batch(2)]
        journal.close()


def test_entries_of_one_commit_naming_one_index_twice_keep_the_later(registry_postgres_url: str) -> None:
    """Entries of a commit go in one statement, which cannot upsert a row twice: then one by one."""
    journal = PgJournal(registry_postgres_url)
    journal.commit([OpenJournal(who("a")), OpenJournal(who("b"))])
    journal.commit(
        [JournalEntry("a", 1, batch(1)), JournalEntry("b", 1, batch(3)), JournalEntry("a", 1, batch(2))]
    )
    journal.commit(
        [JournalEntry("a", 2, batch(4)), JournalEntry("b", 1, batch(5)), JournalEntry("b", 2, batch(6))]
    )
    loaded = {w.opened.handle: w for w in journal.load()}
    assert loaded["a"].entries == [batch(2), batch(4)]
    assert loaded["b"].entries == [batch(5), batch(6)]
    journal.close()


def test_a_second_lock_on_the_store_is_refused_naming_the_holder(postgres_url: str) -> None:
    url = store_url(postgres_url)
    with StoreLock(url):
        with pytest.raises(StoreInUse) as refused:
            StoreLock(url).acquire()
        message = str(refused.value)
        assert f"tally serve pid {os.getpid()} on " in message
        assert "stop that one first, give this one another --store, or start it with --standby" in message
    with StoreLock(url):  # released: the next one takes it
        pass


def test_each_coordinator_taking_the_store_gets_the_next_epoch_and_fences_the_one_before(
    postgres_url: str,
) -> None:
    url = store_url(postgres_url)
    first = StoreLock(url)
    first.acquire()
    old_completions, old_journal = (
        PgCompletionStore(postgres_url, first.fence),
        PgJournal(postgres_url, first.fence),
    )
    old_completions.commit([PutCompleted("cp/f", "w1", ["a"])])  # the owner writes
    first.release()  # as when its session ended (kill -9, a database restart) ...
    with StoreLock(url) as second:  # ... and another coordinator took the store over
        assert first.epoch is not None and second.epoch == first.epoch + 1
        # Whatever the deposed one still tries is refused, and nothing of it is written.
        with pytest.raises(Fenced, match=f"its epoch is {first.epoch}, the store's is {second.epoch}"):
            old_completions.commit([PutCompleted("cp/f", "w1", ["b"]), DeleteCompleted("cp/f", ["a"])])
        with pytest.raises(Fenced):
            old_completions.trash("cp/f", "stamp")
        with pytest.raises(Fenced):
            old_journal.commit([ForgetWriter("h-1")])
        assert isinstance(Fenced(url, 1, 2), CompletionWriteError)  # never acknowledged: UNAVAILABLE
        assert old_completions.contains("cp/f", "w1", [b"a", b"b"]) == [True, False]
        new_completions = PgCompletionStore(postgres_url, second.fence)
        new_completions.commit([PutCompleted("cp/f", "w2", ["c"])])  # the new owner writes
        assert new_completions.contains("cp/f", "w2", [b"c"]) == [True]
        new_completions.close()
    old_completions.close()
    old_journal.close()


def test_a_standby_takes_the_store_when_its_holder_lets_go_and_stops_when_asked(postgres_url: str) -> None:
    url = store_url(postgres_url)
    holder, standby = StoreLock(url), StoreLock(url)
    holder.acquire()
    stop = threading.Event()
    took: list[bool] = []
    waiting = threading.Thread(target=lambda: took.append(standby.wait_for(stop)))
    waiting.start()
    assert not took  # the holder is alive: the standby waits
    holder.release()
    waiting.join(30)
    assert took == [True] and standby.epoch == (holder.epoch or 0) + 1
    # A second standby behind the new holder gives up when told to stop, taking nothing.
    late = StoreLock(url)
    stop.set()
    assert late.wait_for(stop) is False and late.epoch is None
    standby.release()


def test_a_standby_that_reached_the_database_waits_out_an_outage_from_its_first_try(
    postgres_url: str,
) -> None:
    """A restart of the database just as a replica starts waiting stopped it ("cannot use the store")."""
    url = store_url(postgres_url)
    holder = StoreLock(url, "holder")
    holder.acquire()
    stop = threading.Event()
    tries = threading.Semaphore(0)
    took: list[bool] = []
    allow_connections(postgres_url, False)
    try:
        assert end_sessions(postgres_url) >= 1  # the holder's lock goes with its session
        with pytest.raises(StoreUnreachable):  # never reached before: one clear error, as at a start
            StoreLock(url, "fresh").wait_for(stop)
        standby = StoreLock(url, "standby")
        waiting = threading.Thread(
            target=lambda: took.append(standby.wait_for(stop, tries.release, reached=True))
        )
        waiting.start()
        for _ in range(2):  # two tries while the database is down: both waited out
            assert tries.acquire(timeout=30)
        assert waiting.is_alive() and not took
    finally:
        allow_connections(postgres_url, True)
    waiting.join(60)
    assert took == [True] and standby.epoch == (holder.epoch or 0) + 1
    standby.release()
    holder.release()


def test_a_replica_name_renewed_moments_ago_is_waited_for_and_refused_only_if_renewed_meanwhile(
    postgres_url: str,
) -> None:
    """A coordinator killed -9 and started again at once under its name (systemd, a StatefulSet) finds
    its own row renewed a moment ago: the start waits out the silence that marks it gone instead of
    exiting; only a row renewed during that wait (a live coordinator under the name) refuses it."""
    url = store_url(postgres_url)

    def never(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s for a name nobody holds")

    check_name_free(url, "r1", sleep=never)  # no row under the name: free at once
    board = ReplicaBoard(url, "r1", "h:1", "h:2")
    try:
        board.announce()  # renewed just now, as a coordinator killed -9 leaves it
        waits: list[float] = []
        check_name_free(url, "r1", sleep=waits.append)  # nobody renewed it while this one waited
        assert len(waits) == 1
        assert TAKE_OVER_AFTER_S - 1 < waits[0] <= TAKE_OVER_AFTER_S + RENEW_EVERY_S
        with pytest.raises(ReplicaNameInUse, match="goes by the replica name 'r1'"):
            check_name_free(url, "r1", sleep=lambda seconds: board.announce())  # a live one renews it
    finally:
        board.close()


def test_an_unreachable_store_is_one_clear_error() -> None:
    url = store_url("postgresql://nobody@127.0.0.1:1/tally")
    with pytest.raises(StoreUnreachable) as failed:
        StoreLock(url).acquire()
    assert "cannot use the PostgreSQL store postgresql+psycopg://nobody@127.0.0.1:1/tally" in str(
        failed.value
    )
    assert "check the URL, that PostgreSQL is running" in str(failed.value)


def test_store_urls_are_normalised_to_psycopg_and_others_refused() -> None:
    assert Settings(store="postgresql://u:pw@h:5432/db").store == "postgresql+psycopg://u:pw@h:5432/db"
    assert Settings(store="postgres://u@h/db").store == "postgresql+psycopg://u@h/db"
    assert Settings(store="postgresql://u@h/db").resolved_registry_url() == "postgresql+psycopg://u@h/db"
    assert Settings(store="postgresql://u@h/db", registry_url="sqlite:///r.db").resolved_registry_url() == (
        "sqlite:///r.db"
    )
    assert Settings().store is None
    for bad in ("mysql://u@h/db", "postgresql+psycopg2://u@h/db", "postgresql://u@h", "not a url"):
        with pytest.raises(ValueError):
            Settings(store=bad)


def test_a_full_disk_says_so_and_what_to_do() -> None:
    from tally_server.store.postgres import write_error

    class DiskFull(Exception):
        sqlstate = "53100"

    refused = sa.exc.OperationalError(
        "COMMIT", {}, DiskFull("could not extend file: No space left on device")
    )
    error = write_error(store_url("postgresql://tally:secret@db/tally"), refused, "completions")
    assert error.disk_full
    assert "the disk of the PostgreSQL store postgresql+psycopg://tally:***@db/tally is full" in str(error)
    assert "free space or grow its volume — Tally retries by itself" in str(error)
    assert "secret" not in str(error) and "secret" not in error.path
