"""The checkpoints' status the owner of a PostgreSQL store publishes for its replicas (pg_status)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import StoreLock, store_url

pytestmark = pytest.mark.postgres


def test_only_the_owner_of_the_current_epoch_publishes_and_a_full_publish_drops_the_rest(
    postgres_url: str,
) -> None:
    url = store_url(postgres_url)
    engine = sa.create_engine(url)
    lock = StoreLock(url, "b")
    lock.acquire()
    owner = StatusBoard(url, lock)
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
        with engine.connect() as conn:  # each row is written with its shard and the owner's epoch
            rows = conn.execute(sa.text("SELECT checkpoint, shard, epoch FROM checkpoint_status")).all()
        assert [tuple(row) for row in rows] == [("a", 0, lock.epoch)]
        # A deposed owner (another took the store: the store's epoch moved on) writes nothing.
        lock.release()
        with StoreLock(url, "c"):
            assert not owner.publish({"a": {"completed_count": 99}, "new": {}}, ["a", "new"])
        assert replica.statuses(["a", "new"]) == {"a": {"completed_count": 5}}
        with pytest.raises(RuntimeError, match="no fence"):  # a replica's board only reads
            replica.publish({"a": {}})
    finally:
        lock.release()
        owner.close()
        replica.close()
        engine.dispose()


def test_statuses_published_together_each_come_back_under_their_own_name_unchanged(postgres_url: str) -> None:
    """One publish of many statuses (sent as one JSON array): each row gets its own status, with every
    character array and JSON quoting could trip on (quotes, backslashes, braces, commas, non-ASCII)."""
    url = store_url(postgres_url)
    lock = StoreLock(url, "many")
    lock.acquire()
    owner = StatusBoard(url, lock)
    replica = StatusBoard(url)
    tricky = ['"', "\\", "{}", "a,b", "é ✓", '\\"', "NULL", "", "line\nbreak", "[1]"]
    statuses = {
        f"many/{i:02d}": {
            "name": f"many/{i:02d}",
            "completed_count": i,
            "writers": [
                {"writer_id": f"w{j}", "labels": {"note": tricky[(i + j) % len(tricky)]}}
                for j in range(i % 4)
            ],
            "fingerprint": {tricky[i % len(tricky)]: tricky[-1 - i % len(tricky)]},
        }
        for i in range(40)
    }
    try:
        assert owner.publish(statuses, list(statuses))
        assert replica.statuses(list(statuses)) == statuses
        changed = {name: {**status, "completed_count": -1} for name, status in list(statuses.items())[::3]}
        assert owner.publish(changed)
        assert replica.statuses(list(statuses)) == {**statuses, **changed}
    finally:
        lock.release()
        owner.close()
        replica.close()
