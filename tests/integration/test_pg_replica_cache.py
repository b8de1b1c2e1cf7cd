"""A replica's own cache of completed ids (store revision s0003), on real ``tally serve`` processes.

A replica answers ids it has seen completed from memory (``tally_replica_cache_hits_total``), the
same answers as the owner's; after any removal of a completion (an anomaly's un-complete, a reset,
an operator's ``DELETE`` in SQL) it never answers from what it cached before; a checkpoint reset and
completed again starts a new cache; and the cache keeps within ``replica_cache_ids``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

import tally
from tally_server.store.postgres import store_url
from tally_server.testing import RunningServer, running_server
from tests.integration.test_pg_replicas import serving_as_replica
from tests.integration.workload import tree

pytestmark = pytest.mark.postgres


def cache_metrics(replica: RunningServer) -> dict[str, float]:
    """The replica's ``tally_replica_cache_*`` samples, by name without the prefix."""
    found = {}
    for line in httpx.get(f"http://{replica.http_address}/metrics").text.splitlines():
        if line.startswith("tally_replica_cache_"):
            name, _, value = line.rpartition(" ")
            found[name.removeprefix("tally_replica_cache_")] = float(value)
    return found


def sql(url: str, statement: str) -> None:
    engine = sa.create_engine(store_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement))
    finally:
        engine.dispose()


@contextlib.contextmanager
def owner_and_replica(
    tmp_path: Path, url: str, cache_ids: int | None = None
) -> Iterator[tuple[RunningServer, RunningServer]]:
    env = {} if cache_ids is None else {"TALLY_REPLICA_CACHE_IDS": str(cache_ids)}
    with (
        running_server(tmp_path / "owner", settle_ms=0, store=url) as owner,
        running_server(tmp_path / "replica", settle_ms=0, store=url, env=env) as replica,
    ):
        assert serving_as_replica(replica), replica.log()
        yield owner, replica


def complete(client: tally.Client, checkpoint: str, sources: list[str], writer_id: str = "w") -> None:
    with client.writer(checkpoint, writer_id=writer_id) as w:
        for source in sources:
            w.apply_deltas(tree(source))
        w.flush()


def test_a_replica_answers_what_it_has_seen_completed_from_its_cache_as_the_owner_does(
    tmp_path: Path, postgres_url: str
) -> None:
    done = [f"s{i}" for i in range(50)]
    asked = done[::-1] + [f"never-{i}" for i in range(20)] + done[:5]  # with duplicates
    with owner_and_replica(tmp_path, postgres_url) as (owner, replica):
        with tally.Client(owner.grpc_address) as at_owner, tally.Client(replica.grpc_address) as at_replica:
            complete(at_owner, "cache/a", done)
            expected = at_owner.are_completed("cache/a", asked)
            assert expected == [s in done for s in asked]
            assert at_replica.are_completed("cache/a", asked) == expected  # fills the cache
            first = cache_metrics(replica)
            assert first["hits_total"] == 0 and first["misses_total"] == len(asked)
            assert first["ids"] == len(done)
            for _ in range(3):
                assert at_replica.are_completed("cache/a", asked) == expected
            after = cache_metrics(replica)
            hits = 3 * (len(done) + 5)  # every completed id asked, from the cache; never-* each time
            assert after["hits_total"] == hits and after["misses_total"] == len(asked) + 3 * 20
            # A completion made since is looked up (it was not cached) and answered at once.
            complete(at_owner, "cache/a", ["never-0"], writer_id="w2")
            assert at_replica.are_completed("cache/a", ["never-0", "s1"]) == [True, True]
            assert cache_metrics(replica)["ids"] == len(done) + 1
            assert cache_metrics(replica)["dropped_total"] == 0
        # The owner has no cache series: it answers from memory.
        assert "tally_replica_cache" not in httpx.get(f"http://{owner.http_address}/metrics").text


def test_after_a_completion_goes_the_replica_never_answers_it_from_its_cache(
    tmp_path: Path, postgres_url: str
) -> None:
    sources = ["a", "b", "c", "d"]
    with owner_and_replica(tmp_path, postgres_url) as (owner, replica):
        with tally.Client(owner.grpc_address) as at_owner, tally.Client(replica.grpc_address) as at_replica:
            complete(at_owner, "cache/un", sources)
            for _ in range(2):  # the second from the cache
                assert at_replica.are_completed("cache/un", sources) == [True] * 4
            assert cache_metrics(replica)["hits_total"] == 4
            # Tally's own path: a writer opened after "b" completed sends deltas for it, an anomaly;
            # the owner un-completes it (a DELETE from completed) before it answers the flush.
            with at_owner.writer("cache/un", writer_id="late") as late:
                late.apply_deltas(tree("b"))
                late.flush()
            assert at_owner.are_completed("cache/un", sources) == [True, False, True, True]
            assert at_replica.are_completed("cache/un", sources) == [True, False, True, True]
            seen = cache_metrics(replica)
            assert seen["dropped_total"] == 1 and seen["hits_total"] == 4  # all 4 asked of the database
            assert at_replica.are_completed("cache/un", sources) == [True, False, True, True]
            assert cache_metrics(replica)["hits_total"] == 7  # cached again under the new number
            # Anyone's SQL: the trigger on completed changes the number all the same.
            sql(postgres_url, "DELETE FROM completed WHERE checkpoint = 'cache/un' AND source_id = 'c'")
            assert at_replica.are_completed("cache/un", sources) == [True, False, False, True]
            assert cache_metrics(replica)["dropped_total"] == 2
            sql(
                postgres_url,
                "UPDATE completed SET source_id = 'z' WHERE checkpoint = 'cache/un' AND source_id = 'd'",
            )
            assert at_replica.are_completed("cache/un", sources) == [True, False, False, False]
            sql(postgres_url, "TRUNCATE completed")
            assert at_replica.are_completed("cache/un", sources) == [False] * 4
            assert cache_metrics(replica)["dropped_total"] == 4


def test_a_checkpoint_reset_and_completed_again_does_not_use_what_was_cached_before(
    tmp_path: Path, postgres_url: str
) -> None:
    with owner_and_replica(tmp_path, postgres_url) as (owner, replica):
        with (
            tally.Client(owner.grpc_address) as at_owner,
            tally.Client(replica.grpc_address) as at_replica,
            httpx.Client(base_url=owner.http_url) as http,
        ):
            complete(at_owner, "cache/again", ["old-1", "old-2", "both"])
            for _ in range(2):
                assert at_replica.are_completed("cache/again", ["old-1", "old-2", "both", "new"]) == [
                    True,
                    True,
                    True,
                    False,
                ]
            assert cache_metrics(replica)["hits_total"] == 3
            moved = http.post("/v1/reset", json={"name": "cache/again"})
            assert moved.status_code == 200, moved.text
            # Made again by its first completion: a new row, a number never given before.
            complete(at_owner, "cache/again", ["both", "new"], writer_id="w2")
            assert at_owner.are_completed("cache/again", ["old-1", "old-2", "both", "new"]) == [
                False,
                False,
                True,
                True,
            ]
            assert at_replica.are_completed("cache/again", ["old-1", "old-2", "both", "new"]) == [
                False,
                False,
                True,
                True,
            ]
            assert cache_metrics(replica)["dropped_total"] == 1


def test_the_cache_keeps_within_its_bound_evicting_the_least_recently_asked_checkpoint(
    tmp_path: Path, postgres_url: str
) -> None:
    with owner_and_replica(tmp_path, postgres_url, cache_ids=30) as (owner, replica):
        with tally.Client(owner.grpc_address) as at_owner, tally.Client(replica.grpc_address) as at_replica:
            ids = {name: [f"{name}-{i}" for i in range(12)] for name in ("x", "y", "z")}
            for name, sources in ids.items():
                complete(at_owner, f"cache/{name}", sources)
            for name in ("x", "y"):
                assert at_replica.are_completed(f"cache/{name}", ids[name]) == [True] * 12
            assert cache_metrics(replica)["ids"] == 24
            assert at_replica.are_completed("cache/x", ids["x"]) == [True] * 12  # x now more recent than y
            assert at_replica.are_completed("cache/z", ids["z"]) == [True] * 12  # 36 > 30: y goes
            seen = cache_metrics(replica)
            assert seen["ids"] == 24 and seen["evicted_total"] == 1
            hits = seen["hits_total"]
            assert at_replica.are_completed("cache/x", ids["x"]) == [True] * 12
            assert cache_metrics(replica)["hits_total"] == hits + 12  # x stayed
            assert at_replica.are_completed("cache/y", ids["y"]) == [True] * 12
            after = cache_metrics(replica)
            assert after["hits_total"] == hits + 12 and after["ids"] <= 30  # y was evicted: asked again
            # One checkpoint past the bound by itself: what fits is cached, every answer is right.
            many = [f"many-{i}" for i in range(40)]
            complete(at_owner, "cache/many", many)
            assert at_replica.are_completed("cache/many", many + ["no"]) == [True] * 40 + [False]
            assert cache_metrics(replica)["ids"] == 30
            assert at_replica.are_completed("cache/many", many) == [True] * 40
