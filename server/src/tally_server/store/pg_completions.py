"""Completions in PostgreSQL: the ``CompletionStore`` of ``tally serve --store postgresql+psycopg://...``.

The same model as the LMDB files, one "file" per writer: a checkpoint's completed set is the union
of its rows ``(checkpoint, origin, source_id)`` over every origin (a writer id, or an import's id).
A commit is one transaction, durable when PostgreSQL's commit returns (``synchronous_commit`` is on
for every session, see ``postgres.create_engine``). Nothing is written to the data directory.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from tally.integrations import nemo_format
from tally_server.domain.compact import U64, Hasher
from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    DeleteCompleted,
    JournalOp,
    LoadedCheckpoint,
    LoadedIndex,
    PutCompleted,
    checkpoint_of,
    checkpoints_of,
)
from tally_server.domain.words import count
from tally_server.store import pg_revisions, postgres
from tally_server.store.pg_arrays import bytea_array, int4_runs
from tally_server.store.pg_journal import PgJournal
from tally_server.store.pg_schema import (
    LEGACY_INDEXES,
    completed_table,
    completion_checkpoints_table,
    store_probe_table,
)
from tally_server.store.shards import Fence, ShardFence, run_fence

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_LOCK_NOT_AVAILABLE = "55P03"
# Rows per step of a load (a server-side cursor), hashed a step at a time.
_LOAD_CHUNK = 1 << 15

_Ids = postgresql.ARRAY(postgresql.BYTEA())
# A commit's writes, sent together in one pipeline on psycopg's own connection (one round trip):
# a put is one INSERT of an array of ids (as fast as COPY for the database, and pipelined).
_PUT_IDS = (
    "INSERT INTO completed (checkpoint, source_id, origin) SELECT %s, id, %s FROM unnest(%b::bytea[]) AS id"
)
# Consecutive puts of a commit (its writers' batches) in one statement: id i goes to checkpoint
# and origin k[i]. One statement is one wait on the socket for the commit's thread, which gives
# the GIL up at each wait and gets it back only after the event loop's switch interval.
_PUT_MANY = (
    "INSERT INTO completed (checkpoint, source_id, origin) "
    "SELECT p.checkpoints[t.k], t.id, p.origins[t.k] "
    "FROM (SELECT %b::text[] AS checkpoints, %b::text[] AS origins) AS p, "
    "unnest(%b::bytea[], %b::int4[]) AS t(id, k)"
)
_TOLERANT = " ON CONFLICT DO NOTHING"
_BEGIN = "BEGIN"
_COMMIT = "COMMIT"
_DELETE_IDS = "DELETE FROM completed WHERE checkpoint = %s AND source_id = ANY(%b::bytea[])"
_MARK = "INSERT INTO completion_checkpoints (checkpoint, created_at) VALUES (%s, %s) ON CONFLICT DO NOTHING"
_CONTAINS = sa.text(
    "SELECT source_id FROM completed "
    "WHERE checkpoint = :checkpoint AND origin = :origin AND source_id = ANY(:ids)"
).bindparams(sa.bindparam("ids", type_=_Ids))
_TRASH = sa.text(
    "WITH moved AS (DELETE FROM completed WHERE checkpoint = :checkpoint "
    "RETURNING checkpoint, source_id, origin) "
    "INSERT INTO completed_trash (checkpoint, stamp, source_id, origin, trashed_at) "
    "SELECT checkpoint, :stamp, source_id, origin, :at FROM moved"
)


def _read(
    method: Callable[Concatenate[PgCompletionStore, str, P], R],
) -> Callable[Concatenate[PgCompletionStore, str, P], R]:
    """A read of one checkpoint whose database cannot be reached raises UNAVAILABLE (retry)."""

    @functools.wraps(method)
    def wrapper(self: PgCompletionStore, checkpoint: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self._check_open()
        try:
            return method(self, checkpoint, *args, **kwargs)
        except postgres.TRANSIENT as exc:
            raise postgres.read_error(
                self._url, exc, f"the completions of checkpoint {checkpoint!r}"
            ) from exc

    return wrapper


def _put(cursor: psycopg.Cursor[Any], puts: list[tuple[PutCompleted, list[bytes]]], tolerant: bool) -> None:
    """Insert the ids of consecutive puts (in one statement); ``tolerant``: skipping those held."""
    if not puts:
        return
    if len(puts) == 1:
        op, keys = puts[0]
        params: tuple[object, ...] = (op.checkpoint, op.writer_id, bytea_array(keys))
        cursor.execute(_PUT_IDS + _TOLERANT if tolerant else _PUT_IDS, params)
        return
    ids = bytea_array([key for _, keys in puts for key in keys])
    which = int4_runs([(k, len(keys)) for k, (_, keys) in enumerate(puts, 1)])
    params = ([op.checkpoint for op, _ in puts], [op.writer_id for op, _ in puts], ids, which)
    cursor.execute(_PUT_MANY + _TOLERANT if tolerant else _PUT_MANY, params)


class PgCompletionStore:
    """Completed ids per checkpoint and origin in PostgreSQL; creates its tables on start.

    Thread-safe (a pool of connections): commits, loads and lookups run on different threads.

    Args:
        url: the store's URL (``postgresql+psycopg://...``; see ``postgres.store_url``).

    Raises:
        postgres.StoreUnreachable: the database cannot be reached, or its tables cannot be created.
    """

    remote = True  # every lookup is a query: the service holds loaded ids in memory

    def __init__(self, url: str, fence: Fence | Callable[[Connection], None] | None = None) -> None:
        """``fence``: called first in every transaction that writes (see ``StoreLock.fence``).

        A ``Fence`` (the store's lock, or the shards' ``ShardFence``): commits send its epoch read
        (``Fence.statement``) with their writes (one round trip less) and check it before they
        commit (``Fence.check_rows``).
        """
        self._read_fence = fence if isinstance(fence, Fence) else None
        # Commits say which checkpoints they carry only to a fence that checks their shards.
        self._carries = isinstance(fence, ShardFence) and fence.store_shards is not None
        self._fence = fence.fence if isinstance(fence, Fence) else fence
        self._url = postgres.store_url(url)
        self.display_url = postgres.display(self._url)
        self._engine = postgres.open_store_engine(self._url, self._prepare)
        # Commits take their connection without the pool's ping (a round trip per commit): the
        # fence, their first statement, finds a connection a restart cut, and the commit runs again
        # on a new pool (a restart cuts every pooled connection at once).
        # In autocommit mode: a commit sends its own BEGIN and COMMIT (see _write), one round trip less.
        self._commit_engine = postgres.create_engine(self._url, pre_ping=False, autocommit=True)
        self._closed = False
        self._lock = threading.Lock()
        self._marked: set[str] = set()  # checkpoints known to have their completion_checkpoints row

    def _prepare(self, engine: sa.Engine) -> None:
        pg_revisions.upgrade_store(engine, self.display_url)
        self._drop_legacy_indexes(engine)

    def _drop_legacy_indexes(self, engine: sa.Engine) -> None:
        """Drop indexes that tables made by earlier versions have: each made every commit slower.

        Waits at most a few seconds for the table's lock (a backup reading it holds one); the index
        then stays until the next start, which only costs speed.
        """
        for index in LEGACY_INDEXES:
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
                    conn.execute(sa.text(f"DROP INDEX IF EXISTS {index}"))
            except sa.exc.OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                    raise
                logger.warning(
                    "index %s of the PostgreSQL store %s is no longer needed and slows commits down, "
                    "but its table is busy (%s); it is dropped at a later start",
                    index,
                    self.display_url,
                    postgres.cause(exc),
                )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the completion store is closed")

    # ----------------------------------------------------------------- writes

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        """Apply ``ops`` in order in one transaction; durable when this returns.

        ``PutCompleted`` adds the ids to the writer's origin (ids it holds already stay);
        ``DeleteCompleted`` removes them from every origin of the checkpoint.

        Raises:
            ValueError: a name with a NUL character, or an id that is empty or over 511 bytes (the
                limit of NeMo Curator's LMDB files, so that every checkpoint can be exported); raised
                before anything is written.
            CompletionWriteError: the database refused or could not be reached; retry.
        """
        return self.commit_with(None, ops)

    def commit_with(
        self,
        first: Callable[[psycopg.Cursor[Any]], None] | None,
        ops: Sequence[CompletionOp],
        carrying: Collection[str] = (),
        *,
        unnamed: bool = False,
    ) -> CommitReport:
        """:meth:`commit`, with ``first(cursor)`` writing in the same transaction, after the fence.

        How a group's journal entries and its completions become durable together (one WAL flush,
        one fence, one round of statements; see ``commit_group``): a failure of either leaves
        nothing of both. ``first`` may run twice (see ``_write``), so it must be idempotent within
        the transaction's retry. ``carrying``: the checkpoints ``first`` writes rows of; the fence
        checks their shards with those of ``ops``, and only those (``ShardFence``). ``unnamed``:
        ``first`` also writes rows of checkpoints it cannot name (journal ops that do not say
        theirs), so the fence checks every shard held as well; so it does for a ``first`` that
        carries nothing named.

        Raises:
            ValueError: as :meth:`commit` (nothing written, ``first`` not called).
            CompletionWriteError: the database refused or could not be reached; retry.
        """
        self._check_open()
        planned: list[tuple[CompletionOp, list[bytes]]] = []
        for op in ops:
            names = (op.checkpoint, op.writer_id) if isinstance(op, PutCompleted) else (op.checkpoint,)
            for name in names:
                if not name or "\x00" in name:
                    raise ValueError(f"name {name!r} cannot be stored in PostgreSQL text; refusing")
            planned.append((op, [nemo_format.encode_key(sid) for sid in op.sources]))
        if not planned and first is None:
            return CommitReport()
        new = sorted({op.checkpoint for op, _ in planned if isinstance(op, PutCompleted)} - self._marked)
        carried = checkpoints_of(ops) | set(carrying) if self._carries else set()
        fenced = (carried, unnamed or (first is not None and not carrying))
        for again in (True, False):
            try:
                try:
                    self._write(first, planned, new, fenced, tolerant=False)
                except psycopg.errors.UniqueViolation:
                    # An id the origin holds already (a retried commit whose first try was durable,
                    # or two puts of one id in a group): nothing of that try stayed; again, skipping
                    # those.
                    self._write(first, planned, new, fenced, tolerant=True)
                break
            except postgres.TRANSIENT_RAW as exc:
                if again and postgres.stale_connection(exc):
                    logger.info(
                        "a pooled connection to %s was closed (%s); committing again",
                        self.display_url,
                        postgres.cause(exc),
                    )
                    # Safe whenever the connection was found closed: a commit is idempotent (its
                    # writes are upserts, or skip what is there already), even one that went through.
                    # The others in the pool are as dead (a restart ends every session): a new pool,
                    # so that neither this try nor the next commits take one of them.
                    self._commit_engine.dispose()
                    continue
                what = "completions" if first is None else "the writers' journal and completions"
                raise postgres.write_error(self._url, exc, what) from exc
        with self._lock:
            self._marked.update(new)
        return CommitReport()

    def commit_group(
        self, journal: PgJournal, journal_ops: Sequence[JournalOp], ops: Sequence[CompletionOp]
    ) -> CommitReport:
        """A group's journal entries, then its completions, in one transaction; durable on return.

        A completion is never durable before the journal entry recording it (they commit
        together), and a failure writes neither: the group committer fails both.

        Raises:
            ValueError: as :meth:`commit` (nothing written).
            CompletionWriteError: the database refused or could not be reached; retry.
        """
        if not journal_ops:
            return self.commit(ops)
        return self.commit_with(
            functools.partial(journal.write, ops=journal_ops),
            ops,
            checkpoints_of(journal_ops) if self._carries else (),
            unnamed=not all(map(checkpoint_of, journal_ops)),
        )

    def _write(
        self,
        first: Callable[[psycopg.Cursor[Any]], None] | None,
        planned: list[tuple[CompletionOp, list[bytes]]],
        new: list[str],
        fenced: tuple[Collection[str], bool],
        tolerant: bool,
    ) -> None:
        """One transaction: the fence, then ``first`` and the ops in order, then the commit.

        The writes go in one pipeline on psycopg's own connection: one round trip for all of them,
        however many ops and entries, and for ``BEGIN`` and the fence's epoch read before them
        (checked once they are through, before the commit). The connection is in autocommit mode
        and the pipeline sends ``BEGIN`` itself: psycopg's own ``BEGIN`` waits for its answer
        before the pipeline goes on (a round trip more, which on a busy machine cost as much as
        the writes). So a commit costs two round trips (three with a fence of another kind, run
        on its own first). A put fails on an id the origin holds already unless ``tolerant`` (then
        it skips those; measured slower). A commit that fails (refused by the fence, say, after its
        writes went through) is rolled back here, before its connection serves another commit.
        """
        with self._commit_engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            try:
                self._transaction(conn, raw, first, planned, new, fenced, tolerant)
            except BaseException:
                # Never left open for the connection's next commit to join: rolled back here, not
                # only by the pool's reset as the connection returns (a commit that was refused
                # must leave nothing, whatever the pool is set to do).
                if raw.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    with contextlib.suppress(psycopg.Error):  # a cut connection: nothing is open
                        raw.rollback()
                raise

    def _transaction(
        self,
        conn: Connection,
        raw: psycopg.Connection[Any],
        first: Callable[[psycopg.Cursor[Any]], None] | None,
        planned: list[tuple[CompletionOp, list[bytes]]],
        new: list[str],
        fenced: tuple[Collection[str], bool],
        tolerant: bool,
    ) -> None:
        carrying, unnamed = fenced  # the checkpoints written, and whether rows of others are too
        with raw.cursor() as epoch, raw.cursor() as cursor:
            if self._read_fence is None:
                cursor.execute(_BEGIN)
                self._fenced(conn)  # its statements run in the transaction just begun
            with raw.pipeline():
                if self._read_fence is not None:
                    epoch.execute(_BEGIN)
                    # First in the transaction, FOR KEY SHARE: the epochs of the shards carried.
                    read, params = self._read_fence.statement(carrying, all_held=unnamed)
                    epoch.execute(read, params or None)
                if first is not None:
                    first(cursor)
                if new:
                    at = time.time()
                    cursor.executemany(_MARK, [(name, at) for name in new])
                puts: list[tuple[PutCompleted, list[bytes]]] = []  # consecutive, sent together
                for op, keys in planned:
                    if not keys:
                        continue
                    if isinstance(op, PutCompleted):
                        puts.append((op, keys))
                        continue
                    _put(cursor, puts, tolerant)
                    puts = []
                    if isinstance(op, DeleteCompleted):
                        cursor.execute(_DELETE_IDS, (op.checkpoint, bytea_array(keys)))
                    else:  # pragma: no cover - guarded by the type checker
                        raise TypeError(f"unknown completion op {op!r}")
                _put(cursor, puts, tolerant)
            if self._read_fence is not None:
                self._read_fence.check_rows(epoch.fetchall(), carrying)
            cursor.execute(_COMMIT)  # durable on return (synchronous_commit is on)

    def _fenced(self, conn: Connection) -> None:
        if self._fence is not None:
            self._fence(conn)

    def probe(self) -> None:
        """Write and commit one small row; raises if that fails (database down, disk full)."""
        self._check_open()
        statement = postgresql.insert(store_probe_table).values(id=1, at=time.time())
        try:
            with self._engine.begin() as conn:
                conn.execute(statement.on_conflict_do_update(index_elements=["id"], set_={"at": time.time()}))
        except postgres.TRANSIENT as exc:
            raise postgres.write_error(self._url, exc, "the storage probe") from exc

    def release_files(self, checkpoint: str, writer_id: str | None = None) -> None:
        """Nothing is kept open per checkpoint or writer here (the ``CompletionStore`` protocol)."""

    def trash(self, checkpoint: str, stamp: str) -> tuple[str, int]:
        """Move the checkpoint's rows to the ``completed_trash`` table under ``stamp``; never deletes.

        Returns where they went and how many origins (writer "files") they came from; ``("", 0)``
        when the checkpoint has no completions of its own.
        """
        self._check_open()
        c = completed_table.c
        try:
            with self._engine.begin() as conn:
                if self._read_fence is not None:
                    run_fence(conn, self._read_fence, (checkpoint,))
                else:
                    self._fenced(conn)
                marked = conn.execute(
                    sa.delete(completion_checkpoints_table)
                    .where(completion_checkpoints_table.c.checkpoint == checkpoint)
                    .returning(completion_checkpoints_table.c.checkpoint)
                ).first()
                origins = conn.execute(
                    sa.select(sa.func.count(sa.distinct(c.origin))).where(c.checkpoint == checkpoint)
                ).scalar_one()
                conn.execute(_TRASH, {"checkpoint": checkpoint, "stamp": stamp, "at": time.time()})
        except postgres.TRANSIENT as exc:
            raise postgres.write_error(self._url, exc, f"the reset of checkpoint {checkpoint!r}") from exc
        with self._lock:
            self._marked.discard(checkpoint)
        if marked is None and not origins:
            return "", 0
        return f"table completed_trash (checkpoint {checkpoint!r}, stamp {stamp!r})", int(origins)

    # ------------------------------------------------------------------ reads

    @_read
    def exists(self, checkpoint: str) -> bool:
        """Whether the checkpoint ever had a completion committed since its last reset."""
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(completion_checkpoints_table.c.checkpoint).where(
                    completion_checkpoints_table.c.checkpoint == checkpoint
                )
            ).first()
        return row is not None

    @_read
    def load(self, checkpoint: str) -> LoadedCheckpoint:
        """Every completed id of the checkpoint (no unreadable files on PostgreSQL)."""
        c = completed_table.c
        with self._engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            rows = conn.execute(sa.select(c.source_id).where(c.checkpoint == checkpoint).distinct())
            completed = {bytes(r[0]).decode() for r in rows}
            origins = conn.execute(sa.select(c.origin).where(c.checkpoint == checkpoint).distinct())
            return LoadedCheckpoint(completed=completed, unreadable=[], origins=sorted(origins.scalars()))

    @_read
    def load_index(self, checkpoint: str, hasher: Hasher) -> LoadedIndex:
        """The sorted hashes of each origin's ids (what a compact index is built from)."""
        c = completed_table.c
        result = LoadedIndex(origins=[], hashes=[], files=[], unreadable=[])
        query = sa.select(c.origin, c.source_id).where(c.checkpoint == checkpoint).order_by(c.origin)
        with self._engine.connect() as conn:
            rows = conn.execution_options(stream_results=True, yield_per=_LOAD_CHUNK).execute(query)
            for origin, group in itertools.groupby(rows, key=lambda row: str(row[0])):
                parts: list[U64] = []
                while chunk := [bytes(r[1]) for r in itertools.islice(group, _LOAD_CHUNK)]:
                    parts.append(hasher.of_keys(chunk, len(chunk)))
                hashes = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
                hashes.sort()
                result.origins.append(origin)
                result.hashes.append(hashes)
                result.files.append(f"completed/{checkpoint}/{origin}")
        return result

    def contains(self, checkpoint: str, origin: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether the origin holds each key.

        A database that cannot be reached holds none (as an unreadable LMDB file): a source then
        reads as not completed and replays, never the other way round.
        """
        self._check_open()
        if not keys:
            return []
        try:
            with self._engine.connect() as conn:
                params = {"checkpoint": checkpoint, "origin": origin, "ids": list(keys)}
                found = {bytes(r[0]) for r in conn.execute(_CONTAINS, params)}
        except postgres.TRANSIENT as exc:
            logger.warning(
                "checkpoint %r: cannot look up %s in the PostgreSQL store %s (%s); answering not completed",
                checkpoint,
                count(len(keys), "completed id"),
                self.display_url,
                postgres.cause(exc),
            )
            return [False] * len(keys)
        return [key in found for key in keys]

    @_read
    def keys_after(
        self, checkpoint: str, origins: Sequence[str], after: bytes, limit: int
    ) -> tuple[list[bytes], bool]:
        """Up to ``limit`` distinct ids of these origins after ``after``, in byte order.

        Also says whether those are the last.
        """
        c = completed_table.c
        query = (
            sa.select(c.source_id)
            .where(c.checkpoint == checkpoint, c.origin.in_(list(origins)), c.source_id > after)
            .distinct()
            .order_by(c.source_id)
            .limit(limit + 1)
        )
        with self._engine.connect() as conn:
            keys = [bytes(r[0]) for r in conn.execute(query)]
        return keys[:limit], len(keys) <= limit

    @_read
    def keys_matching(
        self, checkpoint: str, origins: Sequence[str], wanted: Callable[[bytes], bool]
    ) -> list[bytes]:
        """Every id of these origins for which ``wanted`` is true (once per origin holding it)."""
        c = completed_table.c
        query = sa.select(c.source_id).where(c.checkpoint == checkpoint, c.origin.in_(list(origins)))
        found: list[bytes] = []
        with self._engine.connect() as conn:
            rows = conn.execution_options(stream_results=True, yield_per=_LOAD_CHUNK).execute(query)
            for row in rows:
                key = bytes(row[0])
                if wanted(key):
                    found.append(key)
        return found

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Release the database connections; the store refuses further calls. Idempotent."""
        self._closed = True
        self._engine.dispose()
        self._commit_engine.dispose()

    def __enter__(self) -> PgCompletionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
