"""The registry's schema revisions on real SQLite files and a real PostgreSQL (issue #13).

From an empty database to head, the schema ``create_all`` makes; from a database an earlier Tally
made with ``create_all`` (no ``alembic_version``, some tables missing, rows in it), adopted and
upgraded with its rows; a database a newer Tally upgraded, refused; two coordinators at once on
PostgreSQL, one upgrade. And the guard: ``registry_schema`` never drifts from the revisions.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tally_server.domain.ports import CheckpointRecord, EventRecord
from tally_server.store import pg_schema, registry_schema
from tally_server.store.registry import SqlRegistry
from tally_server.store.registry_migrations import (
    FIRST_REVISION,
    RegistrySchemaError,
    current_revision,
    head_revision,
    include_name,
)
from tests.polling import wait_until
from tests.unit.store.conftest import POSTGRES_URL

FreshUrl = Callable[[], str]

# The tables of the first Tally with a registry, before cursors, failures, claims and totals.
OLDEST_TABLES = ("checkpoints", "writers", "events", "progress_samples")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FreshUrl]:
    """Makes URLs of empty databases: SQLite files, or PostgreSQL schemas (dropped afterwards)."""
    schemas: list[str] = []
    admin: sa.Engine | None = None
    if request.param == "postgresql":
        admin = request.getfixturevalue("registry_postgres_admin")

    def make() -> str:
        if admin is None:
            return f"sqlite:///{tmp_path / f'{uuid.uuid4().hex[:8]}.sqlite3'}"
        schema = f"tally_test_{uuid.uuid4().hex[:16]}"
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        schemas.append(schema)
        url = sa.make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
        return url.render_as_string(hide_password=False)

    yield make
    if admin is not None:
        with admin.begin() as conn:
            for schema in schemas:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


def engine_on(url: str) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def schema_of(url: str) -> dict[str, Any]:
    """Tables, columns (type, nullable), primary keys and indexes, as the database reports them."""
    engine = engine_on(url)
    try:
        inspector = sa.inspect(engine)
        shape: dict[str, Any] = {}
        for table in sorted(set(inspector.get_table_names()) - {"alembic_version"}):
            shape[table] = {
                "columns": [
                    (c["name"], type(c["type"]).__name__, str(c["type"]), c["nullable"])
                    for c in inspector.get_columns(table)
                ],
                "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                    for i in inspector.get_indexes(table)
                ),
            }
        return shape
    finally:
        engine.dispose()


def drift(url: str) -> list[Any]:
    """What autogenerate would put in a new revision: ``registry_schema`` against the database."""
    engine = engine_on(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"include_name": include_name})
            return list(compare_metadata(context, registry_schema.metadata))
    finally:
        engine.dispose()


def version_rows(url: str) -> list[str]:
    engine = engine_on(url)
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(sa.text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def test_an_empty_database_is_upgraded_to_head_with_the_schema_create_all_makes(fresh_url: FreshUrl) -> None:
    migrated, created = fresh_url(), fresh_url()
    with SqlRegistry(migrated) as reg:
        reg.write_batch(checkpoints=[CheckpointRecord("run", 1.0, 2.0, {"input": "x"})])
        assert [c.name for c in reg.list_checkpoints()] == ["run"]
    engine = engine_on(created)
    registry_schema.metadata.create_all(engine)
    engine.dispose()

    assert version_rows(migrated) == [head_revision()]
    expected = schema_of(created)
    assert set(expected) == set(registry_schema.metadata.tables)
    assert schema_of(migrated) == expected


def test_the_revisions_make_exactly_registry_schema(fresh_url: FreshUrl) -> None:
    """Fails when registry_schema.py changes without a revision in store/migrations/versions."""
    url = fresh_url()
    SqlRegistry(url).close()
    assert drift(url) == []


def test_the_drift_check_sees_a_change_without_a_revision(fresh_url: FreshUrl) -> None:
    url = fresh_url()
    SqlRegistry(url).close()
    engine = engine_on(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_writers_checkpoint"))
    engine.dispose()
    assert [diff[0] for diff in drift(url)] == ["add_index"]


def test_a_database_made_before_revisions_is_adopted_with_its_rows(fresh_url: FreshUrl) -> None:
    url = fresh_url()
    engine = engine_on(url)
    oldest = [registry_schema.metadata.tables[name] for name in OLDEST_TABLES]
    registry_schema.metadata.create_all(engine, tables=oldest)
    with engine.begin() as conn:
        conn.execute(
            registry_schema.checkpoints_table.insert().values(
                name="run", created_at=1.0, last_activity_at=2.0, fingerprint={"input": "x"}
            )
        )
        conn.execute(
            registry_schema.events_table.insert().values(
                checkpoint="run", kind="writer_opened", message="opened", at=3.0, data={}
            )
        )
        if engine.dialect.name == "postgresql":  # the PostgreSQL store's tables, in the same database
            pg_schema.metadata.create_all(conn)
    engine.dispose()
    assert current_revision(engine_on(url)) is None

    with SqlRegistry(url) as reg:
        assert reg.list_checkpoints() == [CheckpointRecord("run", 1.0, 2.0, {"input": "x"})]
        assert [e.message for e in reg.list_events("run")] == ["opened"]
        reg.write_batch(events=[EventRecord("run", "writer_closed", "closed", 4.0)])  # a newer table's
        reg.write_batch(checkpoints=[CheckpointRecord("run", 1.0, 5.0, {"input": "x"})])

    assert version_rows(url) == [head_revision()]
    assert set(registry_schema.metadata.tables) <= set(schema_of(url))
    assert drift(url) == []


def test_a_database_with_tallys_tables_made_otherwise_is_refused(fresh_url: FreshUrl) -> None:
    url = fresh_url()
    engine = engine_on(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE checkpoints (name VARCHAR PRIMARY KEY, note VARCHAR)"))
    engine.dispose()

    with pytest.raises(RegistrySchemaError) as refused:
        SqlRegistry(url)
    message = str(refused.value)
    assert "has Tally's tables but not as any Tally made them" in message
    assert "checkpoints" in message and "note" in message
    assert "alembic_version" not in schema_of(url) and set(schema_of(url)) == {"checkpoints"}


def test_a_database_a_newer_tally_upgraded_is_refused(fresh_url: FreshUrl) -> None:
    url = fresh_url()
    SqlRegistry(url).close()
    engine = engine_on(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    engine.dispose()

    with pytest.raises(RegistrySchemaError) as refused:
        SqlRegistry(url)
    display = sa.make_url(url).render_as_string(hide_password=True)
    assert str(refused.value) == (
        f"the registry database {display} is at schema revision 9999_from_the_future, which this Tally "
        f"does not know (its newest is {head_revision()}): a newer Tally has upgraded it; run that Tally "
        "or a newer one, or restore the backup taken before the upgrade"
    )
    assert version_rows(url) == ["9999_from_the_future"]


def test_reopening_at_head_changes_nothing(fresh_url: FreshUrl) -> None:
    url = fresh_url()
    SqlRegistry(url).close()
    before = schema_of(url)
    SqlRegistry(url).close()
    assert schema_of(url) == before
    assert version_rows(url) == [head_revision()] == [FIRST_REVISION]


@pytest.mark.postgres
def test_a_coordinator_waits_for_anothers_upgrade_on_postgresql(registry_postgres_url: str) -> None:
    """The upgrade holds an advisory lock: while another session holds it, nothing is created."""
    key = int.from_bytes(b"tallymig", "big", signed=True)
    holder = engine_on(registry_postgres_url)
    opened: list[SqlRegistry] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:
            opened.append(SqlRegistry(registry_postgres_url))
        except BaseException as exc:
            failed.append(exc)

    def waiting_on_the_lock() -> bool:
        with holder.connect() as conn:
            return bool(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                        "AND ((classid::bigint << 32) | objid::bigint) = :key"
                    ),
                    {"key": key},
                ).scalar()
            )

    with holder.connect() as lock:
        lock.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": key})
        thread = threading.Thread(target=start)
        thread.start()
        wait_until(waiting_on_the_lock, timeout=30, what="the registry to wait on the migration lock")
        assert "checkpoints" not in schema_of(registry_postgres_url)
        lock.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        lock.commit()
    thread.join(timeout=60)
    holder.dispose()
    assert failed == []
    opened[0].close()
    assert version_rows(registry_postgres_url) == [head_revision()]


@pytest.mark.postgres
def test_two_coordinators_starting_at_once_on_postgresql_upgrade_once(registry_postgres_url: str) -> None:
    failed: list[BaseException] = []
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        try:
            SqlRegistry(registry_postgres_url).close()
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failed == []
    assert version_rows(registry_postgres_url) == [head_revision()]
    assert drift(registry_postgres_url) == []
