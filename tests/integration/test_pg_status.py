"""The checkpoints' status the owner of a PostgreSQL store publishes for its replicas (pg_status)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tally_server.store import pg_revisions, pg_schema
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import store_url

pytestmark = pytest.mark.postgres


def test_only_the_owner_of_the_current_epoch_publishes_and_a_full_publish_drops_the_rest(
    postgres_url: str,
) -> None:
    url = store_url(postgres_url)
    engine = sa.create_engine(url)
    pg_revisions.upgrade_store(engine, "the test's store")
    with engine.begin() as conn:
        conn.execute(sa.insert(pg_schema.store_epoch_table).values(id=1, epoch=2, holder="b", since=0.0))
    epoch = {"now": 2}
    owner = StatusBoard(url, lambda: epoch["now"])
    replica = StatusBoard(url)
    try:
        assert owner.publish({"a": {"completed_count": 1}, "b/c": {"completed_count": 2}}, ["a", "b/c"])
        assert sorted(replica.names()) == ["a", "b/c"]
        assert replica.statuses(["a", "nope"]) == {"a": {"completed_count": 1}}
        # Only what changed is written; the other rows stay as they were.
        assert owner.publish({"a": {"completed_count": 5}})
        assert replica.statuses(["a", "b/c"]) == {"a": {"completed_count": 5}, "b/c": {"completed_count": 2}}
        # A full publish (the names to keep) drops checkpoints the owner no longer knows.
        assert owner.publish({}, ["a"])
        assert replica.names() == ["a"]
        # A deposed owner (the store's epoch moved on) writes nothing.
        epoch["now"] = 1
        assert not owner.publish({"a": {"completed_count": 99}, "new": {}}, ["a", "new"])
        assert replica.statuses(["a", "new"]) == {"a": {"completed_count": 5}}
    finally:
        owner.close()
        replica.close()
        engine.dispose()
