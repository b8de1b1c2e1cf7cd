"""A replica's reads of completions (``replica.CompletedReader``) against a real PostgreSQL."""

from __future__ import annotations

import contextlib

import pytest
import sqlalchemy as sa

from tally_server.domain.ports import PutCompleted
from tally_server.replica import CompletedReader
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.postgres import store_url
from tests.pg_sessions import end_sessions

pytestmark = pytest.mark.postgres


def test_only_committed_completions_are_read_each_call_on_its_own_snapshot(postgres_url: str) -> None:
    with PgCompletionStore(postgres_url) as store:
        store.commit([PutCompleted("cp/r", "w1", ["a", "é"]), PutCompleted("cp/r", "w2", ["a"])])
        store.commit([PutCompleted("cp/other", "w1", ["b"])])
    reader = CompletedReader(store_url(postgres_url))
    writer = sa.create_engine(postgres_url)
    try:
        with writer.connect() as conn:
            conn.execute(
                sa.text("INSERT INTO completed (checkpoint, source_id, origin) VALUES ('cp/r', 'b', 'w1')")
            )
            # Not committed yet: never reported, on a pooled connection or a new one.
            for _ in range(7):  # past psycopg's preparing of the statement (its 5th run)
                assert reader.are_completed("cp/r", ["a", "b", "é", "a"]) == [True, False, True, True]
            assert reader.completed_after("cp/r", "", 10) == ["a", "é"]
            conn.commit()
        assert reader.are_completed("cp/r", ["a", "b", "é", "a"]) == [True, True, True, True]
        assert reader.completed_after("cp/r", "a", 10) == ["b", "é"]
        assert reader.are_completed("cp/r", []) == []
        assert reader.are_completed("cp/none", ["a", "b"]) == [False, False]
    finally:
        writer.dispose()
        reader.close()


def test_reads_on_pooled_connections_a_database_restart_cut_go_through(postgres_url: str) -> None:
    """Reads skip the pool's ping: the first finds its connection closed, then reads on a new pool."""
    with PgCompletionStore(postgres_url) as store:
        store.commit([PutCompleted("cp/r", "w", ["a"])])
    reader = CompletedReader(store_url(postgres_url))
    try:
        with contextlib.ExitStack() as held:  # three connections in the pool, as concurrent reads leave
            for _ in range(3):
                held.enter_context(reader._engine.connect())
        assert reader.are_completed("cp/r", ["a", "b"]) == [True, False]
        assert end_sessions(postgres_url) == 3  # as a restart does: every session of the database ends
        assert reader.are_completed("cp/r", ["a", "b"]) == [True, False]
        assert reader.are_completed("cp/r", ["b", "a"]) == [False, True]
        assert reader.completed_after("cp/r", "", 10) == ["a"]
    finally:
        reader.close()
