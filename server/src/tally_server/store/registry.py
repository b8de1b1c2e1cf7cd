"""The registry: checkpoints, writers and events in a SQL database through SQLAlchemy 2.

SQLite in the data directory by default (``default_sqlite_url``), PostgreSQL by URL
(``postgresql+psycopg://user@host/db``). Completion state is not here: it lives in the LMDB
files (``lmdb_files``), so losing the registry never loses a completion.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from tally_server.domain.checkpoint import WriterState
from tally_server.domain.ports import (
    CheckpointRecord,
    ClaimRecord,
    CursorRecord,
    EventRecord,
    FailedAttemptRecord,
    ProgressRecord,
    SourceFailuresRecord,
    WriterRecord,
)
from tally_server.errors import Unavailable
from tally_server.store.registry_fence import fence_write
from tally_server.store.registry_migrations import upgrade_registry
from tally_server.store.registry_schema import (
    budgets_table,
    checkpoint_record,
    checkpoints_table,
    claims_table,
    cursors_table,
    declared_counts_table,
    declared_table,
    event_record,
    events_table,
    failures_table,
    progress_table,
    writer_record,
    writers_table,
)
from tally_server.store.shards import Fence

REGISTRY_FILENAME = "registry.sqlite3"

_SUPPORTED_DIALECTS = ("sqlite", "postgresql")
# Handles named in one statement at most (SQLite's limit on bound parameters is 32,766).
_HANDLES_PER_STATEMENT = 1000

P = ParamSpec("P")
R = TypeVar("R")

# Errors of the database or the way to it (down, restarting, locked, disk full): transient, so
# callers get UNAVAILABLE and retry. Integrity and data errors are bugs and propagate as they are.
_TRANSIENT = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError, sa.exc.TimeoutError)


class RegistryUnavailable(Unavailable):
    """The registry database cannot be reached or written right now.

    Attributes:
        disk_full: the disk holding the database is full (the message then says so and what to do).
    """

    def __init__(self, message: str, *, cause: str, disk_full: bool) -> None:
        super().__init__(message, cause=cause)
        self.disk_full = disk_full


def _transient_as_unavailable(method: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except _TRANSIENT as exc:
            registry = args[0]
            assert isinstance(registry, SqlRegistry)
            raise registry.unavailable(exc) from exc

    return wrapper


def registry_url(url: str) -> sa.URL:
    """The parsed registry URL, checked to be SQLite or PostgreSQL.

    Raises:
        ValueError: not a URL, or another database; the message never holds the password.
    """
    try:
        parsed = sa.make_url(url.strip())
    except (sa.exc.ArgumentError, ValueError):  # ValueError: a port that is not a number
        # Not repeated: what could not be parsed may hold a password.
        raise ValueError(
            "registry URL is not a database URL (it is not repeated here, as it may hold a password); "
            "use sqlite:///<path> or postgresql+psycopg://<user>@<host>/<db>"
        ) from None
    dialect = parsed.get_backend_name()
    if dialect not in _SUPPORTED_DIALECTS:
        raise ValueError(
            f"registry database {parsed.render_as_string(hide_password=True)!r} uses {dialect!r}; "
            "use sqlite:///<path> or postgresql+psycopg://<user>@<host>/<db>"
        )
    return parsed


def default_sqlite_url(data_dir: Path) -> str:
    """The registry URL used when none is configured: ``<data_dir>/registry.sqlite3``."""
    path = (Path(data_dir) / REGISTRY_FILENAME).absolute()
    return sa.URL.create("sqlite", database=str(path)).render_as_string()


class SqlRegistry:
    """Checkpoints, writers and events in SQLite or PostgreSQL; upgrades its schema on start.

    Raises ``RegistrySchemaError`` (an ``OSError``) on a database a newer Tally has upgraded.

    Methods block; the service calls them from one worker thread at a time (not always the same
    thread, hence ``check_same_thread=False`` for SQLite).

    Args:
        url: an SQLAlchemy URL, e.g. ``sqlite:////var/lib/tally/registry.sqlite3`` or
            ``postgresql+psycopg://tally@db:5432/tally``.
        fence: on a PostgreSQL store whose database holds the registry, the coordinator's fence
            (its store lock, or the ``ShardFence`` of its shards): every write about checkpoints
            runs it in its own transaction with the checkpoints it writes, and is refused as a
            whole (``errors.RegistryFenced``, nothing written) if one of them is of a shard
            no longer this coordinator's. None (SQLite, a registry elsewhere): writes as they come.
    """

    def __init__(self, url: str, *, fence: Fence | None = None) -> None:
        parsed = registry_url(url)
        self.fence = fence
        # Never show a password in messages and logs.
        self.display_url = parsed.render_as_string(hide_password=True)
        self._engine = _create_engine(parsed)
        try:
            upgrade_registry(self._engine, self.display_url)
        except _TRANSIENT as exc:
            self._engine.dispose()
            raise self.unavailable(exc) from exc
        except BaseException:
            self._engine.dispose()
            raise

    def unavailable(self, exc: BaseException) -> RegistryUnavailable:
        """The UNAVAILABLE error for a transient database failure, saying what to do."""
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]
        hint = "Tally retries by itself"
        disk_full = "full" in cause.lower() or "no space" in cause.lower()
        if disk_full:
            hint = "the disk holding it is full: free space or grow the volume; Tally retries by itself"
        return RegistryUnavailable(
            f"the registry database {self.display_url} cannot be used right now ({cause}); {hint}",
            cause=cause,
            disk_full=disk_full,
        )

    # ------------------------------------------------------------ checkpoints

    @_transient_as_unavailable
    def list_checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint, by name."""
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(checkpoints_table).order_by(checkpoints_table.c.name)).all()
        return [checkpoint_record(row) for row in rows]

    # ---------------------------------------------------------------- writers

    @_transient_as_unavailable
    def list_writers(self, checkpoint: str) -> list[WriterRecord]:
        """The checkpoint's writers, oldest first."""
        w = writers_table.c
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(writers_table).where(w.checkpoint == checkpoint).order_by(w.opened_at, w.handle)
            ).all()
        return [writer_record(row) for row in rows]

    @_transient_as_unavailable
    def find_writer(self, handle: str) -> WriterRecord | None:
        """The writer whose handle this is, or None."""
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(writers_table).where(writers_table.c.handle == handle)).first()
        return writer_record(row) if row is not None else None

    @_transient_as_unavailable
    def mark_open_writers(
        self,
        state: str,
        at: float,
        keep: Collection[str] = (),
        owns: Callable[[str], bool] | None = None,
    ) -> list[WriterRecord]:
        """Set every writer still ``open`` and not in ``keep`` (handles) to ``state``, closed at ``at``.

        Returns the writers changed.

        Called after a restart: writers the journal brought back stay open; the others' pending
        state did not survive the old process. ``owns``: only writers of the checkpoints it accepts
        change; the others' belong to other coordinators of the store, live, and stay open.

        Raises:
            RegistryFenced: a writer to change is of a checkpoint whose shard is no longer this
                coordinator's (``fence``); none was changed.
        """
        w = writers_table.c
        condition = w.state == WriterState.OPEN
        if keep:
            condition = sa.and_(condition, w.handle.not_in(list(keep)))
        with self._engine.begin() as conn:
            if owns is not None:
                return self._mark_owned(conn, condition, state, at, owns)
            # One statement, so a writer opened concurrently is either updated and returned or
            # left alone, never updated silently.
            rows = conn.execute(
                sa.update(writers_table)
                .where(condition)
                .values(state=state, closed_at=at)
                .returning(*writers_table.c)
            ).all()
            # Fenced after the update (it names the checkpoints changed), before the commit: the
            # read holds the epochs' rows until then, so a takeover waits for it or refuses it.
            self._fenced(conn, {str(row.checkpoint) for row in rows})
        return sorted((writer_record(row) for row in rows), key=lambda r: (r.opened_at, r.handle))

    def _mark_owned(
        self,
        conn: Connection,
        condition: sa.ColumnElement[bool],
        state: str,
        at: float,
        owns: Callable[[str], bool],
    ) -> list[WriterRecord]:
        """``mark_open_writers`` of the owned checkpoints' writers, in the caller's transaction.

        The open rows are locked as they are read (``FOR UPDATE``; SQLite has one writer anyway)
        and only those owned are updated, by handle and still open: a writer opened meanwhile is
        not among them, so it is left alone, never updated silently.
        """
        w = writers_table.c
        found = conn.execute(sa.select(w.handle, w.checkpoint).where(condition).with_for_update()).all()
        owned = [row for row in found if owns(str(row.checkpoint))]
        self._fenced(conn, {str(row.checkpoint) for row in owned})
        handles = sorted(str(row.handle) for row in owned)
        rows: list[Any] = []
        for start in range(0, len(handles), _HANDLES_PER_STATEMENT):
            chunk = handles[start : start + _HANDLES_PER_STATEMENT]
            rows += conn.execute(
                sa.update(writers_table)
                .where(w.handle.in_(chunk), w.state == WriterState.OPEN)
                .values(state=state, closed_at=at)
                .returning(*writers_table.c)
            ).all()
        return sorted((writer_record(row) for row in rows), key=lambda r: (r.opened_at, r.handle))

    @_transient_as_unavailable
    def write_batch(
        self,
        *,
        checkpoints: Sequence[CheckpointRecord] = (),
        writers: Sequence[WriterRecord] = (),
        events: Sequence[EventRecord] = (),
        samples: Sequence[ProgressRecord] = (),
    ) -> None:
        """Upsert checkpoints and writers, append events and samples, in one transaction.

        Event ids come from the database and are stored into each ``event.id``.

        Raises:
            RegistryFenced: a row is of a checkpoint whose shard is no longer this coordinator's
                (``fence``); nothing was written.
        """
        carrying = {x.name for x in checkpoints} | {x.checkpoint for x in writers}
        carrying |= {x.checkpoint for x in events} | {x.checkpoint for x in samples}
        with self._engine.begin() as conn:
            self._fenced(conn, carrying)
            # One executemany a table: a flush carries a row per writer that beat since the last one.
            self._upsert_many(conn, checkpoints_table, [dataclasses.asdict(x) for x in checkpoints])
            self._upsert_many(conn, writers_table, [dataclasses.asdict(x) for x in writers])
            if events:
                self._insert_events(conn, events)
            if samples:
                conn.execute(sa.insert(progress_table), [dataclasses.asdict(x) for x in samples])

    # ----------------------------------------------------------------- events

    def _insert_events(self, conn: Connection, events: Sequence[EventRecord]) -> None:
        """Insert ``events`` in one statement (per 1,000 rows); stores each one's new id, in order.

        Ids only ever come from the database, so paging by id stays ordered, and they must increase
        in the order the events happened. Each dialect assigns them in the order the rows are
        inserted: SQLite takes the largest rowid plus one for each row of a VALUES list in turn;
        PostgreSQL is given ``INSERT ... SELECT ... ORDER BY`` the rows' order (SQLAlchemy's
        ``sort_by_parameter_order``), which takes the ids from the sequence in that order. The ids
        returned (RETURNING promises no order on SQLite) are therefore the events' ids sorted.
        """
        rows = [dataclasses.asdict(event) for event in events]
        for row in rows:
            del row["id"]
        in_order = self._engine.dialect.name == "postgresql"
        insert = sa.insert(events_table).returning(events_table.c.id, sort_by_parameter_order=in_order)
        ids = sorted(int(i) for i in conn.execute(insert, rows).scalars())
        for event, new_id in zip(events, ids, strict=True):
            event.id = new_id

    @_transient_as_unavailable
    def list_events(
        self, checkpoint: str, *, limit: int = 100, before_id: int | None = None
    ) -> list[EventRecord]:
        """The checkpoint's events, newest first; ``before_id`` pages backwards."""
        e = events_table.c
        query = sa.select(events_table).where(e.checkpoint == checkpoint)
        if before_id is not None:
            query = query.where(e.id < before_id)
        query = query.order_by(e.id.desc()).limit(max(limit, 0))
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [event_record(row) for row in rows]

    # --------------------------------------------------------------- progress

    @_transient_as_unavailable
    def list_samples(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressRecord]:
        """The checkpoint's samples at or after ``since``, oldest first."""
        c = progress_table.c
        query = sa.select(progress_table).where(c.checkpoint == checkpoint, c.at >= since).order_by(c.at)
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [ProgressRecord(row.checkpoint, float(row.at), int(row.completed_count)) for row in rows]

    @_transient_as_unavailable
    def latest_counts(self) -> dict[str, int]:
        """The completed count of each checkpoint's newest sample (status without loading id sets)."""
        c = progress_table.c
        newest = sa.select(c.checkpoint, sa.func.max(c.at).label("at")).group_by(c.checkpoint).subquery()
        query = sa.select(c.checkpoint, c.completed_count).join(
            newest, sa.and_(c.checkpoint == newest.c.checkpoint, c.at == newest.c.at)
        )
        with self._engine.connect() as conn:
            return {row.checkpoint: int(row.completed_count) for row in conn.execute(query)}

    @_transient_as_unavailable
    def delete_samples(self, checkpoint: str) -> None:
        """Forget a checkpoint's progress history (on reset)."""
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            conn.execute(sa.delete(progress_table).where(progress_table.c.checkpoint == checkpoint))

    # ---------------------------------------------------------------- cursors

    @_transient_as_unavailable
    def save_cursors(self, cursors: Sequence[CursorRecord]) -> None:
        """Write cursors (each replacing its source's), in one transaction: durable on return."""
        with self._engine.begin() as conn:
            self._fenced(conn, {cursor.checkpoint for cursor in cursors})
            for cursor in cursors:
                self._upsert(conn, cursors_table, dataclasses.asdict(cursor))

    @_transient_as_unavailable
    def get_cursor(self, checkpoint: str, source_id: str) -> CursorRecord | None:
        """The cursor saved for a source, if any."""
        c = cursors_table.c
        query = sa.select(cursors_table).where(c.checkpoint == checkpoint, c.source_id == source_id)
        with self._engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None:
            return None
        return CursorRecord(
            row.checkpoint, row.source_id, bytes(row.data), float(row.saved_at), row.writer_id
        )

    @_transient_as_unavailable
    def delete_cursors(self, checkpoint: str, source_ids: Sequence[str] | None = None) -> None:
        """Drop these sources' cursors (every cursor of the checkpoint with None)."""
        c = cursors_table.c
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            if source_ids is None:
                conn.execute(sa.delete(cursors_table).where(c.checkpoint == checkpoint))
                return
            ids = list(source_ids)
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                conn.execute(
                    sa.delete(cursors_table).where(c.checkpoint == checkpoint, c.source_id.in_(chunk))
                )

    # ---------------------------------------------------------------- failures

    @_transient_as_unavailable
    def record_failure(
        self, checkpoint: str, source_id: str, attempt: FailedAttemptRecord, keep: int
    ) -> tuple[int, bool]:
        """Count a failed attempt, keeping the latest ``keep`` reasons.

        Answers the attempts so far, and whether it was a repeat of a kept one (same
        ``attempt_id``), which is not counted again.
        """
        c = failures_table.c
        entry = dataclasses.asdict(attempt)
        if not attempt.attempt_id:
            del entry["attempt_id"]
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            row = conn.execute(
                sa.select(c.attempts, c.recent)
                .where(c.checkpoint == checkpoint, c.source_id == source_id)
                .with_for_update()
            ).first()
            if (
                row is not None
                and attempt.attempt_id
                and any(kept.get("attempt_id") == attempt.attempt_id for kept in row.recent)
            ):
                return int(row.attempts), True
            attempts = (int(row.attempts) if row is not None else 0) + 1
            recent = ([*list(row.recent), entry] if row is not None else [entry])[-keep:]
            self._upsert(
                conn,
                failures_table,
                {
                    "checkpoint": checkpoint,
                    "source_id": source_id,
                    "attempts": attempts,
                    "recent": recent,
                    "last_at": attempt.at,
                },
            )
        return attempts, False

    @_transient_as_unavailable
    def list_failures(
        self, checkpoint: str | None = None, source_ids: Sequence[str] | None = None
    ) -> list[SourceFailuresRecord]:
        """Sources with failed attempts, by checkpoint and source id (all checkpoints with None)."""
        c = failures_table.c
        query = sa.select(failures_table).order_by(c.checkpoint, c.source_id)
        if checkpoint is not None:
            query = query.where(c.checkpoint == checkpoint)
        if source_ids is not None:
            query = query.where(c.source_id.in_(list(source_ids)))
        with self._engine.connect() as conn:
            return [_failures_record(row) for row in conn.execute(query)]

    @_transient_as_unavailable
    def failures_after(
        self, checkpoint: str, after: str, limit: int, min_attempts: int = 0
    ) -> list[SourceFailuresRecord]:
        """A page of ``list_failures``: up to ``limit`` sources after ``after`` in code point order.

        Only sources with ``min_attempts`` failed attempts or more.
        """
        c = failures_table.c
        source_id = self._code_points(c.source_id)
        query = (
            sa.select(failures_table)
            .where(c.checkpoint == checkpoint, source_id > after, c.attempts >= min_attempts)
            .order_by(source_id)
            .limit(limit)
        )
        with self._engine.connect() as conn:
            return [_failures_record(row) for row in conn.execute(query)]

    @_transient_as_unavailable
    def clear_failures(self, checkpoint: str, source_ids: Sequence[str] | None = None) -> None:
        """Forget these sources' failed attempts (every one of the checkpoint with None)."""
        c = failures_table.c
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            if source_ids is None:
                conn.execute(sa.delete(failures_table).where(c.checkpoint == checkpoint))
                return
            ids = list(source_ids)
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                conn.execute(
                    sa.delete(failures_table).where(c.checkpoint == checkpoint, c.source_id.in_(chunk))
                )

    @_transient_as_unavailable
    def set_budget(self, checkpoint: str, max_attempts: int) -> None:
        """Record a checkpoint's failure budget (0: unlimited)."""
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            self._upsert(conn, budgets_table, {"checkpoint": checkpoint, "max_attempts": max_attempts})

    @_transient_as_unavailable
    def list_budgets(self) -> dict[str, int]:
        """Every checkpoint's failure budget that is set."""
        with self._engine.connect() as conn:
            return {row.checkpoint: int(row.max_attempts) for row in conn.execute(sa.select(budgets_table))}

    @_transient_as_unavailable
    def budget_of(self, checkpoint: str) -> int:
        """A checkpoint's failure budget (0: none set, unlimited)."""
        c = budgets_table.c
        with self._engine.connect() as conn:
            found = conn.execute(sa.select(c.max_attempts).where(c.checkpoint == checkpoint)).scalar()
        return int(found or 0)

    # ---------------------------------------------------------------- claims

    @_transient_as_unavailable
    def take_claims(
        self, checkpoint: str, source_ids: Sequence[str], holder: str, writer_id: str, at: float
    ) -> dict[str, int]:
        """Claim sources for a writer, durably: each one's new token, above any it had before."""
        c = claims_table.c
        tokens: dict[str, int] = {}
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            ids = list(source_ids)
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                query = sa.select(c.source_id, c.token).where(
                    c.checkpoint == checkpoint, c.source_id.in_(chunk)
                )
                old = {row.source_id: int(row.token) for row in conn.execute(query)}
                rows = []
                for sid in chunk:
                    tokens[sid] = old.get(sid, 0) + 1
                    rows.append(
                        {
                            "checkpoint": checkpoint,
                            "source_id": sid,
                            "token": tokens[sid],
                            "holder": holder,
                            "writer_id": writer_id,
                            "acquired_at": at,
                        }
                    )
                self._upsert_many(conn, claims_table, rows)
        return tokens

    @_transient_as_unavailable
    def release_claims(self, checkpoint: str, holder: str, source_ids: Sequence[str] | None = None) -> None:
        """End a writer's claims (on these sources, or all of them with None); tokens stay."""
        c = claims_table.c
        mine = sa.update(claims_table).where(c.checkpoint == checkpoint, c.holder == holder).values(holder="")
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            if source_ids is None:
                conn.execute(mine)
                return
            ids = list(source_ids)
            for start in range(0, len(ids), 1000):
                conn.execute(mine.where(c.source_id.in_(ids[start : start + 1000])))

    @_transient_as_unavailable
    def live_claims(self) -> list[ClaimRecord]:
        """Every claim not released, by checkpoint and source id."""
        c = claims_table.c
        query = sa.select(claims_table).where(c.holder != "").order_by(c.checkpoint, c.source_id)
        with self._engine.connect() as conn:
            return [
                ClaimRecord(
                    row.checkpoint,
                    row.source_id,
                    int(row.token),
                    row.holder,
                    row.writer_id,
                    float(row.acquired_at),
                )
                for row in conn.execute(query)
            ]

    # ---------------------------------------------------------------- declared sources

    @_transient_as_unavailable
    def add_declared(self, checkpoint: str, source_ids: Sequence[str], count: int) -> None:
        """Add declared sources (those declared already are left as they are) and raise the count."""
        dialect = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        with self._engine.begin() as conn:
            self._fenced(conn, [checkpoint])
            ids = list(source_ids)
            for start in range(0, len(ids), 5000):
                rows = [{"checkpoint": checkpoint, "source_id": sid} for sid in ids[start : start + 5000]]
                conn.execute(dialect.insert(declared_table).values(rows).on_conflict_do_nothing())
            if count:
                c = declared_counts_table.c
                old = conn.execute(sa.select(c.count).where(c.checkpoint == checkpoint)).scalar()
                if old is None or count > old:
                    self._upsert(conn, declared_counts_table, {"checkpoint": checkpoint, "count": count})

    @_transient_as_unavailable
    def list_declared(self) -> tuple[dict[str, set[str]], dict[str, int]]:
        """Every checkpoint's declared sources and declared count."""
        declared: dict[str, set[str]] = {}
        with self._engine.connect() as conn:
            for row in conn.execute(sa.select(declared_table)):
                declared.setdefault(row.checkpoint, set()).add(row.source_id)
            c = declared_counts_table.c
            query = sa.select(c.checkpoint, c.count.label("declared"))
            counts = {row.checkpoint: int(row.declared) for row in conn.execute(query)}
        return declared, counts

    @_transient_as_unavailable
    def declared_after(self, checkpoint: str, after: str, limit: int) -> list[str]:
        """Up to ``limit`` declared sources of a checkpoint after ``after``, in code point order."""
        c = declared_table.c
        source_id = self._code_points(c.source_id)
        query = (
            sa.select(c.source_id)
            .where(c.checkpoint == checkpoint, source_id > after)
            .order_by(source_id)
            .limit(limit)
        )
        with self._engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def _code_points(self, column: sa.ColumnElement[str]) -> sa.ColumnElement[str]:
        """``column`` compared and sorted by code point, as Python sorts ``str`` (the owner's order).

        SQLite's default collation is that already (UTF-8 bytes); PostgreSQL's follows the
        database's locale unless told "C" (UTF-8 bytes again).
        """
        return column.collate("C") if self._engine.dialect.name == "postgresql" else column

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close every pooled connection."""
        self._engine.dispose()

    def __enter__(self) -> SqlRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _fenced(self, conn: Connection, carrying: Collection[str]) -> None:
        """Inside a write transaction: go on only while ``carrying``'s shards are this coordinator's.

        A write about no checkpoint (nothing to write, no writer to mark) is not fenced.

        Raises:
            RegistryFenced: one is not (``fence``); the transaction must write nothing.
        """
        if self.fence is not None and carrying:
            fence_write(conn, self.fence, carrying)

    def _upsert_many(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
        """Insert or update ``rows`` (all with the same columns) in one executemany."""
        if not rows:
            return
        keys = [column.name for column in table.primary_key.columns]
        dialect = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        insert = dialect.insert(table)
        updates = {name: insert.excluded[name] for name in rows[0] if name not in keys}
        conn.execute(insert.on_conflict_do_update(index_elements=keys, set_=updates), rows)

    def _upsert(self, conn: Connection, table: sa.Table, values: dict[str, Any]) -> None:
        keys = [column.name for column in table.primary_key.columns]
        updates = {name: value for name, value in values.items() if name not in keys}
        # Both dialects spell it INSERT ... ON CONFLICT DO UPDATE: one atomic round trip.
        if self._engine.dialect.name == "postgresql":
            pg = postgresql.insert(table).values(values)
            conn.execute(pg.on_conflict_do_update(index_elements=keys, set_=updates))
        else:
            lite = sqlite.insert(table).values(values)
            conn.execute(lite.on_conflict_do_update(index_elements=keys, set_=updates))


def _create_engine(url: sa.URL) -> Engine:
    if url.get_backend_name() != "sqlite":
        # pre_ping: a pooled connection may have been cut by a database restart.
        return sa.create_engine(url, pool_pre_ping=True)
    database = url.database or ""
    in_memory = database in ("", ":memory:") or url.query.get("mode") == "memory"
    if in_memory:
        # One shared connection, or each pooled connection would see its own empty database.
        engine = sa.create_engine(url, connect_args={"check_same_thread": False}, poolclass=StaticPool)
    else:
        if not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            # WAL lets the dashboard read while the worker writes. synchronous=NORMAL is durable
            # across process crashes; a power loss may drop the last registry commits, which
            # holds only bookkeeping (completions are fsynced in the LMDB files).
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=10000")
        finally:
            cursor.close()

    return engine


def _failures_record(row: Any) -> SourceFailuresRecord:
    return SourceFailuresRecord(
        row.checkpoint,
        row.source_id,
        int(row.attempts),
        [
            FailedAttemptRecord(
                str(a["reason"]), float(a["at"]), str(a["writer_id"]), str(a.get("attempt_id", ""))
            )
            for a in row.recent
        ],
    )
