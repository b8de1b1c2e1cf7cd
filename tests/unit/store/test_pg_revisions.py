"""The PostgreSQL store's schema revisions on a real PostgreSQL (a fresh schema per test).

From an empty database to head, exactly the tables ``pg_schema`` declares; from a store an earlier
Tally made with ``create_all`` (no version table, rows in it), adopted, with each journaled writer's
checkpoint filled from its bytes; a store a newer Tally upgraded, or tables made otherwise, refused
with nothing changed; the registry and the store in one database, each with its own revision.
"""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from tally_server.domain.journal import Applied, Opened
from tally_server.store import pg_revisions, pg_schema
from tally_server.store.journal import encode_entry, encode_opened
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.pg_journal import PgJournal
from tally_server.store.pg_revisions import REVISIONS, StoreSchemaError
from tally_server.store.postgres import StoreLock, store_url
from tally_server.store.registry import SqlRegistry
from tally_server.store.registry_migrations import REVISIONS as REGISTRY_REVISIONS

pytestmark = pytest.mark.postgres


def engine_on(url: str) -> sa.Engine:
    return sa.create_engine(store_url(url), poolclass=sa.pool.NullPool)


def tables(url: str) -> set[str]:
    engine = engine_on(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def drift(url: str) -> list[object]:
    """What differs between the database's store tables and ``pg_schema`` (empty: nothing)."""
    engine = engine_on(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"include_name": REVISIONS.include_name})
            return list(compare_metadata(context, pg_schema.metadata))
    finally:
        engine.dispose()


def opened(handle: str, checkpoint: str) -> Opened:
    return Opened(handle, checkpoint, f"writer-{handle}", "host", 7, {}, {}, 1.5, "tok")


def make_pre_revision_store(url: str) -> None:
    """A store as a Tally of before revisions left it: ``create_all`` of its tables, rows in them."""
    scripts = ScriptDirectory.from_config(REVISIONS.config())
    metadata: sa.MetaData = scripts.get_revision("s0001").module.metadata
    engine = engine_on(url)
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            # The index that Tallys of before it was dropped still have: adopted all the same.
            conn.execute(sa.text("CREATE INDEX ix_completed_origin ON completed (checkpoint, origin)"))
            conn.execute(
                sa.text("INSERT INTO completed (checkpoint, source_id, origin) VALUES ('cp/a', 'x', 'w1')")
            )
            for handle, checkpoint in (("h1", "cp/a"), ("h2", "cp/b"), ("h3", "cp/a")):
                conn.execute(
                    sa.text("INSERT INTO journal_writers (handle, opened) VALUES (:h, :o)"),
                    {"h": handle, "o": encode_opened(opened(handle, checkpoint))},
                )
            conn.execute(
                sa.text("INSERT INTO journal_entries (handle, idx, entry) VALUES ('h1', 1, :e)"),
                {"e": encode_entry(Applied(7, [("s1", "t1", 1)]))},
            )
    finally:
        engine.dispose()


def test_an_empty_store_is_made_at_head_with_exactly_pg_schemas_tables(registry_postgres_url: str) -> None:
    PgJournal(registry_postgres_url).close()
    assert REVISIONS.current(engine_on(registry_postgres_url)) == REVISIONS.head() == "s0002"
    assert set(pg_schema.metadata.tables) | {pg_schema.VERSION_TABLE} == tables(registry_postgres_url)
    # The drift guard: a change to pg_schema without a revision fails here.
    assert drift(registry_postgres_url) == []


def test_a_store_made_before_revisions_is_adopted_with_its_rows(
    registry_postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    make_pre_revision_store(registry_postgres_url)
    assert REVISIONS.current(engine_on(registry_postgres_url)) is None
    with caplog.at_level(logging.INFO, logger="tally_server.store.schema_revisions"):
        journal = PgJournal(registry_postgres_url)
    said = [r.getMessage() for r in caplog.records]
    assert any("predates schema revisions: adopting it at revision s0001" in m for m in said), said
    assert any("from schema revision s0001 to s0002" in m for m in said), said
    try:
        assert REVISIONS.current(engine_on(registry_postgres_url)) == REVISIONS.head()
        engine = engine_on(registry_postgres_url)
        with engine.connect() as conn:
            filled = dict(conn.execute(sa.text("SELECT handle, checkpoint FROM journal_writers")).all())
        engine.dispose()
        assert filled == {"h1": "cp/a", "h2": "cp/b", "h3": "cp/a"}  # from each row's opened bytes
        everyone = {w.opened.handle: w for w in journal.load()}
        assert set(everyone) == {"h1", "h2", "h3"}
        assert [w.opened.handle for w in journal.load(["cp/a"])] == ["h1", "h3"]
        assert [w.opened.handle for w in journal.load(["cp/b", "cp/none"])] == ["h2"]
        assert journal.load([]) == []
        (h1,) = [w for w in journal.load(["cp/a"]) if w.opened.handle == "h1"]
        assert h1.entries == everyone["h1"].entries and len(h1.entries) == 1 and h1.last_index == 1
    finally:
        journal.close()
    with PgCompletionStore(registry_postgres_url) as store:
        assert store.load("cp/a").completed == {"x"}  # the rows it had are still there
    # Only the legacy index differs from pg_schema: the completion store drops it at start.
    assert drift(registry_postgres_url) == []


def test_rows_written_without_the_checkpoint_are_still_found_by_checkpoint(
    registry_postgres_url: str,
) -> None:
    """A Tally of before s0002 still running beside an upgraded store writes rows without the column."""
    journal = PgJournal(registry_postgres_url)
    try:
        engine = engine_on(registry_postgres_url)
        with engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO journal_writers (handle, opened) VALUES ('old', :o)"),
                {"o": encode_opened(opened("old", "cp/a"))},
            )
        engine.dispose()
        assert [w.opened.handle for w in journal.load(["cp/a"])] == ["old"]
        assert journal.load(["cp/b"]) == []
    finally:
        journal.close()


def test_a_store_a_newer_tally_upgraded_is_refused_and_left_as_it_is(registry_postgres_url: str) -> None:
    PgJournal(registry_postgres_url).close()
    engine = engine_on(registry_postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {pg_schema.VERSION_TABLE} SET version_num = 's0099'"))
    engine.dispose()
    pg_revisions._upgraded.clear()  # as a new process would start
    with pytest.raises(StoreSchemaError) as refused:
        PgJournal(registry_postgres_url)
    message = str(refused.value)
    assert "s0099" in message and "newer Tally" in message and "s0002" in message
    assert "PASSWORD" not in message
    with pytest.raises(StoreSchemaError):
        StoreLock(store_url(registry_postgres_url), "me").acquire()


def test_store_tables_made_otherwise_are_refused_and_nothing_is_changed(registry_postgres_url: str) -> None:
    engine = engine_on(registry_postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE journal_writers (handle TEXT PRIMARY KEY, opened TEXT)"))
    engine.dispose()
    with pytest.raises(StoreSchemaError) as refused:
        PgCompletionStore(registry_postgres_url)
    assert "journal_writers" in str(refused.value) and "--store" in str(refused.value)
    assert tables(registry_postgres_url) == {"journal_writers"}  # the upgrade was one transaction


def test_the_registry_and_the_store_share_a_database_each_at_its_own_revision(
    registry_postgres_url: str,
) -> None:
    registry = SqlRegistry(registry_postgres_url)
    try:
        PgJournal(registry_postgres_url).close()
    finally:
        registry.close()
    registry = SqlRegistry(registry_postgres_url)  # a restart: the registry's check ignores the store
    registry.close()
    assert REGISTRY_REVISIONS.current(engine_on(registry_postgres_url)) == REGISTRY_REVISIONS.head()
    assert REVISIONS.current(engine_on(registry_postgres_url)) == REVISIONS.head()
    assert drift(registry_postgres_url) == []
