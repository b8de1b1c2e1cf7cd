"""Every session of the store's database ended under a real ``tally serve --store``, while writers commit.

What a PostgreSQL restart (or an administrator's ``pg_terminate_backend``) does to the coordinator:
every pooled connection is dead at once. Here the sessions of the test's own database are ended
again and again (never the machine's PostgreSQL itself) while writers send batches over raw gRPC and
count each call that fails. Each failed call is resent unchanged, as the SDK does. The coordinator
must ride through it: a call fails only when its commit failed (nothing acknowledged), the
completed set is exactly what the acknowledged batches completed, and ``/readyz`` says ready again
with no restart.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import sqlalchemy as sa

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.store.postgres import (
    INCUMBENT_GRACE_S,
    STORE_LOCK_KEY,
    TAKE_OVER_AFTER_S,
    display,
    store_url,
)
from tally_server.testing import RunningServer, running_server
from tests.integration.raw import deltas
from tests.integration.workload import tree
from tests.pg_sessions import allow_connections, end_sessions, end_sessions_lock_holders_last
from tests.polling import wait_until

pytestmark = pytest.mark.postgres

T = TypeVar("T")
CHECKPOINT = "pg/reconnect"
WRITERS = 4
CUTS = 10
# Batches every writer has acknowledged between two cuts: each cut lands while all of them commit.
BATCHES_PER_ROUND = 3


class Writer:
    """One writer on raw gRPC: numbered batches, each resent unchanged until acknowledged.

    Each batch completes one source and leaves another one sink short (never completed).
    """

    def __init__(self, name: str, stub: pb_grpc.CoordinatorStub) -> None:
        self.name = name
        self.stub = stub
        self.failed: list[str] = []  # what each failed call said
        self.completed: list[str] = []  # sources of acknowledged batches, each complete
        self.open: list[str] = []  # sources of acknowledged batches, each one sink short
        self.acknowledged = threading.Semaphore(0)  # released once per acknowledged batch
        self.handle = ""

    def call(self, rpc: Callable[..., T], request: Any) -> T:
        """``rpc(request)``, again while it fails UNAVAILABLE (nothing acknowledged); counts failures."""
        while True:
            try:
                return rpc(request, timeout=60)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                self.failed.append(f"{rpc._method!r}: {err.details()}")  # type: ignore[attr-defined]

    def run(self, stop: threading.Event) -> None:
        opened = self.call(
            self.stub.OpenWriter, pb.OpenWriterRequest(checkpoint=CHECKPOINT, writer_id=self.name)
        )
        self.handle = opened.handle
        seq = 0
        while not stop.is_set():
            seq += 1
            done, short = f"{self.name}-{seq}", f"{self.name}-{seq}-short"
            batch = deltas(tree(done) + tree(short)[:-1])
            self.call(
                self.stub.ApplyDeltas, pb.ApplyDeltasRequest(handle=self.handle, deltas=batch, batch_seq=seq)
            )
            self.completed.append(done)
            self.open.append(short)
            self.acknowledged.release()

    def close(self) -> pb.CloseWriterResponse:
        return self.call(self.stub.CloseWriter, pb.CloseWriterRequest(handle=self.handle))


def committed(url: str) -> set[str]:
    """The checkpoint's committed completed ids, read in the database."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT DISTINCT source_id FROM completed WHERE checkpoint = :c"), {"c": CHECKPOINT}
            )
            return {bytes(row[0]).decode() for row in rows}
    finally:
        engine.dispose()


def store_epoch(url: str) -> int | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT epoch FROM store_epoch WHERE id = 1")).scalar()
    finally:
        engine.dispose()


def lock_holder(url: str) -> int | None:
    """The backend pid of the session holding the store's lock, if one does."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database()) "
                    "AND classid::bigint = :hi AND objid::bigint = :lo"
                ),
                {"hi": STORE_LOCK_KEY >> 32, "lo": STORE_LOCK_KEY & 0xFFFFFFFF},
            ).scalar()
    finally:
        engine.dispose()


def ready(server: RunningServer) -> bool:
    return httpx.get(f"{server.http_url}/readyz", timeout=5).status_code == 200


@pytest.fixture
def server(tmp_path: Path, postgres_url: str) -> Iterator[RunningServer]:
    with running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as running:
        yield running


def test_sessions_ended_again_and_again_while_writers_commit_fail_at_most_one_call_per_writer(
    server: RunningServer, postgres_url: str
) -> None:
    stop = threading.Event()
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        writers = [Writer(f"w{i}", stub) for i in range(WRITERS)]
        threads = [threading.Thread(target=w.run, args=(stop,), name=w.name) for w in writers]
        for thread in threads:
            thread.start()
        try:
            holder = None
            for _ in range(CUTS):
                for writer in writers:  # every writer committing since the last cut
                    for _ in range(BATCHES_PER_ROUND):
                        assert writer.acknowledged.acquire(timeout=60), f"{writer.name} stopped committing"
                # ... and the store's lock taken again on a new session (its keeper's next check)
                wait_until(
                    lambda cut=holder: lock_holder(postgres_url) not in (None, cut),
                    timeout=30,
                    what="the coordinator holding the store's lock again",
                )
                holder = lock_holder(postgres_url)
                assert end_sessions(postgres_url) >= 2  # the lock's session and the commits'
            for writer in writers:  # and once more after the last cut
                for _ in range(BATCHES_PER_ROUND):
                    assert writer.acknowledged.acquire(timeout=60), f"{writer.name} stopped committing"
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
        closed = {w.name: w.close() for w in writers}

    failures = {w.name: w.failed for w in writers}
    print("failed calls per writer:", {name: len(calls) for name, calls in failures.items()})
    assert all(len(calls) <= 1 for calls in failures.values()), failures
    # Taking the store's lock again after each cut, the coordinator kept its epoch: it never refused
    # its own commits as those of a deposed owner.
    assert store_epoch(postgres_url) == 1
    log = server.log()
    assert "no longer owns" not in log
    assert "checking the store's lock failed" not in log  # a cut renewal is no bug with a traceback
    # Nothing acknowledged is lost, nothing else is completed (the short sources stay open).
    done = {source for w in writers for source in w.completed}
    short = {source for w in writers for source in w.open}
    assert committed(postgres_url) == done
    for w in writers:
        assert closed[w.name].incomplete_count == len(w.open)
        assert set(closed[w.name].incomplete_sources) <= short
    model = {source: source in done for source in done | short}
    assert answers(server, sorted(model)) == model
    wait_until(lambda: ready(server), timeout=30, what="/readyz to say ready again")
    assert server.process.poll() is None  # never restarted


def test_a_replica_leaves_the_owner_its_store_across_cuts_of_every_session_yet_replaces_a_killed_one(
    tmp_path: Path, postgres_url: str
) -> None:
    """Every session ended (as a restart does) frees the lock; the owner, not its replica, takes it back."""
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        owner = stack.enter_context(running_server(tmp_path / "owner", settle_ms=0, store=postgres_url))
        replica = stack.enter_context(running_server(tmp_path / "replica", settle_ms=0, store=postgres_url))
        assert "serving as a replica" in replica.log()
        with grpc.insecure_channel(owner.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            writers = [Writer(f"w{i}", stub) for i in range(2)]
            threads = [threading.Thread(target=w.run, args=(stop,), name=w.name) for w in writers]
            for thread in threads:
                thread.start()
            try:
                holder = None
                for _ in range(6):
                    for writer in writers:
                        for _ in range(BATCHES_PER_ROUND):
                            assert writer.acknowledged.acquire(timeout=60), (
                                f"{writer.name} stopped committing"
                            )
                    wait_until(
                        lambda cut=holder: lock_holder(postgres_url) not in (None, cut),
                        timeout=30,
                        what="a coordinator holding the store's lock again",
                    )
                    assert store_epoch(postgres_url) == 1  # the owner took it back, no one else
                    holder = lock_holder(postgres_url)
                    assert end_sessions(postgres_url) >= 3  # the owner's and the replica's
                for writer in writers:
                    for _ in range(BATCHES_PER_ROUND):
                        assert writer.acknowledged.acquire(timeout=60), f"{writer.name} stopped committing"
            finally:
                stop.set()
                for thread in threads:
                    thread.join(timeout=120)
            for writer in writers:
                writer.close()
        assert store_epoch(postgres_url) == 1
        assert "taking over store" not in replica.log()
        assert "no longer owns" not in owner.log() and owner.process.poll() is None
        done = {source for w in writers for source in w.completed}
        short = {source for w in writers for source in w.open}
        assert committed(postgres_url) == done
        model = {source: source in done for source in done | short}
        assert answers(owner, sorted(model)) == model

        # A dead owner is still replaced within the lease: its replica takes the store over.
        owner.kill()
        killed_at = time.time()
        wait_until(lambda: store_epoch(postgres_url) == 2, timeout=60, what="the replica taking the store")
        took_at = took_over_at(postgres_url)
        print(f"kill -9 of the owner to the replica's takeover: {took_at - killed_at:.2f} s")
        assert took_at - killed_at < TAKE_OVER_AFTER_S, took_at - killed_at
        wait_until(lambda: "taking over store" in replica.log(), timeout=60, what="the replica serving")
        wait_until(lambda: ready(replica), timeout=60, what="the replica ready as the owner")
        assert answers(replica, sorted(model)) == model


def test_a_replica_leaves_the_owner_its_store_when_the_database_comes_back_after_a_long_outage(
    tmp_path: Path, postgres_url: str
) -> None:
    """Down longer than the grace (a slow restart): the owner's renewal is old, yet it keeps the store."""
    with (
        running_server(tmp_path / "owner", settle_ms=0, store=postgres_url) as owner,
        running_server(tmp_path / "replica", settle_ms=0, store=postgres_url) as replica,
    ):
        assert "serving as a replica" in replica.log()
        allow_connections(postgres_url, False)
        try:
            # The owner's lock session last: ended in one sweep, the replica's session could take the
            # lock in the moment between the two ends (seen once in CI), which is not this outage.
            assert end_sessions_lock_holders_last(postgres_url) >= 2
            down_at = time.monotonic()
            wait_until(lambda: not ready(replica), timeout=30, what="the replica finding the database down")
            # The outage itself: down well past the grace (and the owner's last renewal with it).
            wait_until(
                lambda: time.monotonic() - down_at > 3 * INCUMBENT_GRACE_S, what="the outage", timeout=30
            )
        finally:
            allow_connections(postgres_url, True)
        again = f"holding the lock of store {display(store_url(postgres_url))} again (epoch 1)"
        wait_until(
            lambda: again in owner.log() or "taking over store" in replica.log(),
            timeout=60,
            what="the owner (or its replica) taking the lock",
        )
        assert again in owner.log() and store_epoch(postgres_url) == 1
        wait_until(lambda: ready(replica), timeout=30, what="the replica ready again")
        assert "taking over store" not in replica.log()
        assert owner.process.poll() is None and "no longer owns" not in owner.log()


def took_over_at(url: str) -> float:
    """When the store's holder took it (``store_epoch.since``, its own clock: this host's)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return float(conn.execute(sa.text("SELECT since FROM store_epoch WHERE id = 1")).scalar_one())
    finally:
        engine.dispose()


def test_while_the_database_refuses_connections_calls_fail_and_nothing_is_acknowledged_then_it_recovers(
    server: RunningServer, postgres_url: str
) -> None:
    """The database "down" (its sessions ended, new ones refused): the coordinator says not ready and
    a batch fails UNAVAILABLE each time it is sent; once the database is back, it says ready again by
    itself and the same batch, sent again, is acknowledged once."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        writer = Writer("w", stub)
        writer.handle = writer.call(
            stub.OpenWriter, pb.OpenWriterRequest(checkpoint=CHECKPOINT, writer_id="w")
        ).handle
        first = deltas(tree("before") + tree("pending")[:-1])
        writer.call(stub.ApplyDeltas, pb.ApplyDeltasRequest(handle=writer.handle, deltas=first, batch_seq=1))
        assert not writer.failed
        second = pb.ApplyDeltasRequest(
            handle=writer.handle, deltas=deltas(tree("during") + tree("pending")[-1:]), batch_seq=2
        )
        allow_connections(postgres_url, False)
        try:
            assert end_sessions(postgres_url) >= 1
            for _ in range(3):  # refused each time, acknowledging nothing
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ApplyDeltas(second, timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Tally retries by itself" in (refused.value.details() or "")
            wait_until(lambda: not ready(server), timeout=30, what="/readyz to say not ready")
            wait_until(
                lambda: "cannot take the store's lock again yet" in server.log(),
                timeout=30,
                what="the store lock's keeper finding the database down",
            )
            assert not ready(server)
        finally:
            allow_connections(postgres_url, True)
        wait_until(lambda: ready(server), timeout=30, what="/readyz to say ready again by itself")
        wait_until(lambda: lock_holder(postgres_url) is not None, timeout=30, what="the lock taken again")
        writer.call(stub.ApplyDeltas, second)  # the same batch, sent again
        closed = writer.close()
        assert closed.incomplete_count == 0
        # Each batch applied once: the refused tries left nothing behind.
        assert (closed.counts.applied, closed.counts.anomalies) == (len(first) + len(second.deltas), 0)
    assert committed(postgres_url) == {"before", "during", "pending"}
    assert answers(server, ["before", "during", "pending", "other"]) == {
        "before": True,
        "during": True,
        "pending": True,
        "other": False,
    }
    assert server.process.poll() is None
    assert f"holding the lock of store {display(store_url(postgres_url))} again (epoch 1)" in server.log()


def answers(server: RunningServer, sources: list[str]) -> dict[str, bool]:
    """What ``server`` answers to ``AreCompleted`` for ``sources``."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        answer = stub.AreCompleted(pb.AreCompletedRequest(checkpoint=CHECKPOINT, source_ids=sources))
    return dict(zip(sources, answer.completed, strict=True))
