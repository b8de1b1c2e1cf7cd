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
from alembic import command
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
    assert REVISIONS.current(engine_on(registry_postgres_url)) == REVISIONS.head() == "s0005"
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
    assert any("from schema revision s0001 to s0005" in m for m in said), said
    try:
        assert REVISIONS.current(engine_on(registry_postgres_url)) == REVISIONS.head()
        engine = engine_on(registry_postgres_url)
        with engine.connect() as conn:
            filled = dict(conn.execute(sa.text("SELECT handle, checkpoint FROM journal_writers")).all())
        engine.dispose()
        assert filled == {"h1": "cp/a", "h2": "cp/b", "h3": "cp/a"}  # from each row's opened bytes
        everyone = {w.opened.handle: w for w in journal.load()}
        assert set(everyone) == {"h1", "h2", "h3"}
        assert [w.opened.handle for w in journal.load(checkpoints=["cp/a"])] == ["h1", "h3"]
        assert [w.opened.handle for w in journal.load(checkpoints=["cp/b", "cp/none"])] == ["h2"]
        assert journal.load(checkpoints=[]) == []
        (h1,) = [w for w in journal.load(checkpoints=["cp/a"]) if w.opened.handle == "h1"]
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
        assert [w.opened.handle for w in journal.load(checkpoints=["cp/a"])] == ["old"]
        assert journal.load(checkpoints=["cp/b"]) == []
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
    assert "s0099" in message and "newer Tally" in message and "s0005" in message
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


def numbers(url: str) -> dict[str, int]:
    """Each checkpoint's ``uncompleted`` number (revision s0003)."""
    engine = engine_on(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT checkpoint, uncompleted FROM completion_checkpoints"))
            return {name: int(number) for name, number in rows}
    finally:
        engine.dispose()


def run(url: str, *statements: str) -> None:
    engine = engine_on(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def upgrade_to(url: str, revision: str) -> None:
    """Make ``url``'s store as it was at ``revision`` (an older Tally's store, to be upgraded)."""
    engine = engine_on(url)
    try:
        with engine.connect() as conn:
            command.upgrade(REVISIONS.config(conn), revision)
            conn.commit()
    finally:
        engine.dispose()


def test_a_store_at_s0002_is_upgraded_in_place_and_every_removal_changes_the_checkpoints_number(
    registry_postgres_url: str,
) -> None:
    """Revision s0003: a number per checkpoint for rows already there, and triggers that replace it
    whenever a statement removes one of its completions (DELETE, UPDATE, TRUNCATE), never with a
    number given before; inserts leave it."""
    url = registry_postgres_url
    upgrade_to(url, "s0002")
    run(
        url,
        "INSERT INTO completion_checkpoints (checkpoint, created_at) VALUES ('cp/a', 1), ('cp/b', 2)",
        "INSERT INTO completed (checkpoint, source_id, origin) VALUES "
        "('cp/a', 'x', 'w1'), ('cp/a', 'y', 'w1'), ('cp/a', 'y', 'w2'), ('cp/b', 'x', 'w1')",
    )
    assert REVISIONS.current(engine_on(url)) == "s0002"
    with PgCompletionStore(url) as store:  # opening the store upgrades it
        assert REVISIONS.current(engine_on(url)) == REVISIONS.head()
        assert store.load("cp/a").completed == {"x", "y"}  # the rows are still there
    assert drift(url) == []
    seen = numbers(url)
    assert len(set(seen.values())) == 2  # a number of its own for each row already there

    def changed(statement: str) -> set[str]:
        nonlocal seen
        before = numbers(url)
        run(url, statement)
        after = numbers(url)
        for name in set(before) & set(after):
            if after[name] != before[name]:
                assert after[name] not in set(seen.values()), (name, after[name])  # never one given before
        seen = {**seen, **{f"{name}@{after[name]}": after[name] for name in after}}
        return {name for name in set(before) | set(after) if before.get(name) != after.get(name)}

    assert changed("INSERT INTO completed VALUES ('cp/a', 'z', 'w1'), ('cp/b', 'z', 'w1')") == set()
    assert changed("INSERT INTO completed VALUES ('cp/a', 'z', 'w1') ON CONFLICT DO NOTHING") == set()
    assert changed("DELETE FROM completed WHERE checkpoint = 'cp/a' AND source_id = 'x'") == {"cp/a"}
    assert changed("DELETE FROM completed WHERE checkpoint = 'cp/a' AND source_id = 'none'") == set()
    assert changed("UPDATE completed SET source_id = 'q' WHERE checkpoint = 'cp/b' AND source_id = 'z'") == {
        "cp/b"
    }
    assert changed("DELETE FROM completed WHERE source_id = 'y' OR source_id = 'q'") == {"cp/a", "cp/b"}
    assert changed("TRUNCATE completed") == {"cp/a", "cp/b"}
    # A checkpoint deleted and made again gets a number never given before.
    assert changed("DELETE FROM completion_checkpoints WHERE checkpoint = 'cp/a'") == {"cp/a"}
    assert changed("INSERT INTO completion_checkpoints (checkpoint, created_at) VALUES ('cp/a', 3)") == {
        "cp/a"
    }
    # A rolled-back removal leaves the number as it was.
    before = numbers(url)
    engine = engine_on(url)
    with engine.connect() as conn:
        conn.execute(sa.text("INSERT INTO completed VALUES ('cp/a', 'r', 'w1')"))
        conn.commit()
        before = numbers(url)
        conn.execute(sa.text("DELETE FROM completed WHERE checkpoint = 'cp/a'"))
        conn.rollback()
    engine.dispose()
    assert numbers(url) == before


def test_a_store_at_s0003_is_upgraded_in_place_and_its_epoch_becomes_a_key(
    registry_postgres_url: str,
) -> None:
    """Revision s0004: a unique constraint on ``store_epoch (id, epoch)`` (what makes a bump wait for commits
    reading it FOR KEY SHARE), added under a store a coordinator served; its epoch goes on from there."""
    url = registry_postgres_url
    upgrade_to(url, "s0003")
    run(url, "INSERT INTO store_epoch (id, epoch, holder, since, renewed_at) VALUES (1, 7, 'old', 1, 0)")

    def keys() -> list[list[str]]:
        engine = engine_on(url)
        try:
            return [c["column_names"] for c in sa.inspect(engine).get_unique_constraints("store_epoch")]
        finally:
            engine.dispose()

    assert keys() == []
    with StoreLock(store_url(url), "new") as lock:  # taking the store upgrades it
        assert REVISIONS.current(engine_on(url)) == REVISIONS.head() == "s0005"
        assert lock.epoch == 8
    assert keys() == [["id", "epoch"]]
    assert drift(url) == []
    engine = engine_on(url)
    with engine.connect() as conn:
        command.downgrade(REVISIONS.config(conn), "s0003")
        conn.commit()
    engine.dispose()
    assert keys() == []
