"""Writers' journals in PostgreSQL: the ``Journal`` of ``tally serve --store postgresql+psycopg://...``.

Two tables, ``journal_writers`` (handle → who the writer is) and ``journal_entries`` (handle, index →
one entry), holding the same bytes as the LMDB journal (``store.journal``'s codec). One transaction
per commit, so a group of entries of many writers costs one WAL flush.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from tally_server.domain.journal import JournaledWriter, Snapshot
from tally_server.domain.ports import (
    ForgetWriter,
    JournalEntry,
    JournalOp,
    OpenJournal,
    checkpoint_of,
    checkpoints_of,
)
from tally_server.store import pg_revisions, postgres
from tally_server.store.journal import decode_entry, decode_opened, encode_entry, encode_opened
from tally_server.store.pg_arrays import bytea_array
from tally_server.store.pg_schema import journal_entries_table, journal_writers_table
from tally_server.store.shards import Fence, run_fence

logger = logging.getLogger(__name__)

# How new journal entries are compressed ("l": lz4; "": the server's default, pglz). PostgreSQL 14+.
_COMPRESSION = sa.text(
    "SELECT attcompression::text FROM pg_attribute "
    "WHERE attrelid = 'journal_entries'::regclass AND attname = 'entry'"
)
_LOCK_NOT_AVAILABLE = "55P03"
_LZ4 = sa.text("ALTER TABLE journal_entries ALTER COLUMN entry SET COMPRESSION lz4")
_PUT_ENTRY = (
    "INSERT INTO journal_entries (handle, idx, entry) VALUES (%s, %s, %b) "
    "ON CONFLICT (handle, idx) DO UPDATE SET entry = excluded.entry"
)
# Consecutive entries of a commit in one statement (one round of the pipeline, one wait for the
# commit's thread, however many entries): psycopg's executemany waits on the socket once per row,
# and each wait gives the GIL up, to get it back only after the event loop's switch interval.
_PUT_ENTRIES = (
    "INSERT INTO journal_entries (handle, idx, entry) "
    "SELECT * FROM unnest(%b::text[], %b::int8[], %b::bytea[]) "
    "ON CONFLICT (handle, idx) DO UPDATE SET entry = excluded.entry"
)
_PUT_WRITER = (
    "INSERT INTO journal_writers (handle, opened, checkpoint) VALUES (%s, %b, %s) "
    "ON CONFLICT (handle) DO UPDATE SET opened = excluded.opened, checkpoint = excluded.checkpoint"
)
_DROP_BEFORE = "DELETE FROM journal_entries WHERE handle = %s AND idx < %s"
_FORGET_WRITER = "DELETE FROM journal_writers WHERE handle = %s"
_FORGET_ENTRIES = "DELETE FROM journal_entries WHERE handle = %s"
_SIZE = sa.text(
    "SELECT pg_total_relation_size('journal_entries') + pg_total_relation_size('journal_writers')"
)


def _put_entries(cursor: psycopg.Cursor[Any], rows: list[tuple[str, int, bytes]]) -> None:
    """Upsert ``rows`` (handle, index, entry): one statement for all of them when it can be one.

    An upsert cannot touch one row twice in a statement: rows naming one (handle, index) twice
    (never sent by the service, whose entries of a writer are numbered on) go one by one, in order.
    """
    if len(rows) > 1 and len({(handle, index) for handle, index, _ in rows}) == len(rows):
        handles, indexes, entries = zip(*rows, strict=True)
        cursor.execute(_PUT_ENTRIES, (list(handles), list(indexes), bytea_array(entries)))
    else:
        cursor.executemany(_PUT_ENTRY, rows)


class PgJournal:
    """The coordinator's writer journals in PostgreSQL; creates its tables on start.

    Args:
        url: the store's URL (``postgresql+psycopg://...``).

    Raises:
        postgres.StoreUnreachable: the database cannot be reached, or its tables cannot be created.
    """

    def __init__(self, url: str, fence: Fence | Callable[[Connection], None] | None = None) -> None:
        """``fence``: called first in every transaction that writes (a ``Fence``'s ``fence``)."""
        self._read_fence = fence if isinstance(fence, Fence) else None
        self._fence = fence.fence if isinstance(fence, Fence) else fence
        self._url = postgres.store_url(url)
        self._engine = postgres.open_store_engine(self._url, self._prepare)
        # Metrics read these while the database may be down: they then show the last known values.
        self._size = 0
        self._entries = 0

    @classmethod
    def _prepare(cls, engine: sa.Engine) -> None:
        pg_revisions.upgrade_store(engine, postgres.display(engine.url))
        cls._use_lz4(engine)

    @staticmethod
    def _use_lz4(engine: sa.Engine) -> None:
        """Compress new entries with lz4 rather than pglz, where the server has it (PostgreSQL 14+).

        An entry holds a whole batch of deltas (hundreds of kB): pglz made a commit of a group's
        entries about 3x slower to serve than lz4, for about the same size on disk.
        """
        with engine.begin() as conn:
            version = conn.dialect.server_version_info or (0,)
            if version < (14,) or conn.execute(_COMPRESSION).scalar() == "l":
                return
            try:
                with conn.begin_nested():
                    # A backup reading the table holds its lock: then pglz it stays until a later start.
                    conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
                    conn.execute(_LZ4)
            except sa.exc.DBAPIError as exc:  # a server without lz4, or the table busy: pglz it stays
                busy = getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE
                if isinstance(exc, postgres.TRANSIENT) and not busy:
                    raise
                say = logger.warning if busy else logger.info  # busy: lz4 comes at a later start
                say("journal entries stay compressed with pglz: %s", postgres.cause(exc))

    def commit(self, ops: Sequence[JournalOp]) -> None:
        """Apply ``ops`` in order in one transaction; durable when this returns.

        Raises:
            CompletionWriteError: the database refused or could not be reached; retry.
        """
        if not ops:
            return
        try:
            with self._engine.begin() as conn:
                if self._read_fence is not None:  # by the shards of the writers' checkpoints
                    unnamed = not all(map(checkpoint_of, ops))  # then by every shard held as well
                    run_fence(conn, self._read_fence, checkpoints_of(ops), all_held=unnamed)
                elif self._fence is not None:
                    self._fence(conn)
                raw = conn.connection.driver_connection
                assert isinstance(raw, psycopg.Connection)
                with raw.pipeline(), raw.cursor() as cursor:
                    self.write(cursor, ops)
        except postgres.TRANSIENT_RAW as exc:
            raise postgres.write_error(self._url, exc, "the writers' journal") from exc

    @staticmethod
    def write(cursor: psycopg.Cursor[Any], ops: Sequence[JournalOp]) -> None:
        """Apply ``ops`` in order on the caller's cursor, in its transaction (fenced by the caller).

        Sends the statements without waiting for them (the caller's pipeline does, once for all of
        them); what ``PgCompletionStore.commit_group`` writes before a group's completions.
        """
        rows: list[tuple[str, int, bytes]] = []  # consecutive entries, inserted together
        for op in ops:
            if isinstance(op, JournalEntry) and not isinstance(op.entry, Snapshot):
                rows.append((op.handle, op.index, encode_entry(op.entry)))
                continue
            if rows:
                _put_entries(cursor, rows)
                rows = []
            if isinstance(op, OpenJournal):
                cursor.execute(
                    _PUT_WRITER, (op.opened.handle, encode_opened(op.opened), op.opened.checkpoint)
                )
            elif isinstance(op, JournalEntry):  # a snapshot: it replaces everything before it
                cursor.execute(_DROP_BEFORE, (op.handle, op.index))
                cursor.execute(_PUT_ENTRY, (op.handle, op.index, encode_entry(op.entry)))
            elif isinstance(op, ForgetWriter):
                cursor.execute(_FORGET_WRITER, (op.handle,))
                cursor.execute(_FORGET_ENTRIES, (op.handle,))
            else:  # pragma: no cover - guarded by the type checker
                raise TypeError(f"unknown journal op {op!r}")
        if rows:
            _put_entries(cursor, rows)

    def load(
        self,
        owns: Callable[[str], bool] | None = None,
        *,
        checkpoints: Collection[str] | None = None,
    ) -> list[JournaledWriter]:
        """Every journaled writer with its entries in order (from its newest snapshot on).

        ``owns``: only the writers of the checkpoints it accepts. The checkpoints the journal holds
        writers of are read first and only the accepted ones' writers loaded, whether the registry
        knows those checkpoints or not (one made just before a crash may have journal rows and no
        registry row yet). ``checkpoints``: only the writers of these checkpoints. Both are found by
        the ``checkpoint`` column; a row written without it, by a Tally of before that column, is
        decoded to tell.
        """
        e, w = journal_entries_table.c, journal_writers_table.c
        writers = sa.select(w.handle, w.opened).order_by(w.handle)
        entries = sa.select(e.handle, e.idx, e.entry).order_by(e.handle, e.idx)
        named = None if checkpoints is None else set(checkpoints)

        @functools.cache  # asked once per checkpoint, however many writers it has
        def accepted(name: str) -> bool:
            return (named is None or name in named) and (owns is None or owns(name))

        try:
            with self._engine.connect() as conn:
                wanted = named
                if owns is not None:
                    held = conn.execute(sa.select(w.checkpoint).where(w.checkpoint.is_not(None)).distinct())
                    wanted = {str(name) for name in held.scalars() if accepted(str(name))}
                if wanted is not None:
                    writers = writers.where(sa.or_(w.checkpoint.in_(sorted(wanted)), w.checkpoint.is_(None)))
                found = {
                    str(handle): JournaledWriter(decode_opened(bytes(raw)))
                    for handle, raw in conn.execute(writers)
                }
                if wanted is not None:
                    found = {h: jw for h, jw in found.items() if accepted(jw.opened.checkpoint)}
                    entries = entries.where(e.handle.in_(sorted(found)))
                for handle, index, raw in conn.execution_options(stream_results=True).execute(entries):
                    writer = found.get(handle)
                    if writer is None:  # pragma: no cover - a commit forgets both in one transaction
                        continue
                    writer.entries.append(decode_entry(bytes(raw)))
                    writer.last_index = int(index)
        except postgres.TRANSIENT as exc:
            raise postgres.StoreUnreachable(self._url, exc) from exc
        return list(found.values())

    def size_bytes(self) -> int:
        """Bytes the journal's tables (with their indexes) take in the database."""
        try:
            with self._engine.connect() as conn:
                self._size = int(conn.execute(_SIZE).scalar_one())
        except postgres.TRANSIENT as exc:
            logger.debug("journal size: %s", postgres.cause(exc))
        return self._size

    def entries(self) -> int:
        """How many entries the journal holds (snapshots keep this bounded per writer)."""
        try:
            with self._engine.connect() as conn:
                self._entries = int(
                    conn.execute(sa.select(sa.func.count()).select_from(journal_entries_table)).scalar_one()
                )
        except postgres.TRANSIENT as exc:
            logger.debug("journal entries: %s", postgres.cause(exc))
        return self._entries

    def memory_bytes(self) -> int:
        """Always 0: the entries stay in the database."""
        return 0

    def close(self) -> None:
        """Release the database connections."""
        self._engine.dispose()
