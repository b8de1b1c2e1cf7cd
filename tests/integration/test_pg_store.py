"""A real ``tally serve --store postgresql+psycopg://...``: issue #11's first piece, one replica.

The same scenarios answer the same on the PostgreSQL store as on the LMDB files; acknowledged
completions and live writers survive SIGTERM and kill -9 (journals in PostgreSQL); a reset keeps
the rows in the trash table; a second coordinator on the store is refused; nothing is written under
the data directory's ``checkpoints/``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import sqlalchemy as sa

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.store.postgres import STORE_LOCK_KEY
from tally_server.testing import RunningServer, running_server
from tests.conftest import load_trace
from tests.integration.workload import nemo_read, tree
from tests.polling import wait_until

pytestmark = pytest.mark.postgres

TALLY = str(Path(sys.executable).parent / "tally")


def sql(url: str, query: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sa.text(query), params)]
    finally:
        engine.dispose()


def ddl(url: str, statement: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def drive(server: RunningServer) -> list[Any]:
    """NeMo Curator's recorded trace, then fan-out trees over two writers and an anomaly.

    Returns every answer the coordinator gave, in order.
    """
    answers: list[Any] = []
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(
            pb.OpenWriterRequest(checkpoint="nemo/trace", writer_id="nemo-host-1")
        ).handle
        for row in load_trace():
            if row["method"] == "are_completed":
                reply = stub.AreCompleted(
                    pb.AreCompletedRequest(checkpoint="nemo/trace", source_ids=row["source_ids"])
                )
                assert list(reply.completed) == row["result"], row["seq"]
                answers.append(list(reply.completed))
            elif row["method"] == "apply_deltas":
                batch = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in row["per_task"]]
                counts = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=batch)).counts
                assert counts.completed == len(row["newly_completed"]), row["seq"]
                answers.append(
                    (counts.applied, counts.skipped, counts.rewritten, counts.anomalies, counts.completed)
                )
            elif row["method"] == "close":
                closed = stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
                answers.append((closed.incomplete_count, sorted(closed.incomplete_sources)))
    with tally.Client(server.grpc_address) as client:
        sources = [f"src{i}" for i in range(5)]
        with (
            client.writer("e2e/shared", writer_id="task-0") as w0,
            client.writer("e2e/shared", writer_id="task-1") as w1,
        ):
            for sid in sources[:3]:
                w0.apply_deltas(tree(sid))
            w0.apply_deltas(tree("src3")[:-1])  # its last sink never reports
            w0.flush()
            answers.append(w1.are_completed(sources))
            w1.apply_deltas(tree("src0"))  # an overlap, not an anomaly: w1 opened before src0 completed
            w1.apply_deltas(tree("src4"))
            w1.flush()
            answers.append(w0.are_completed(sources))
        with client.writer("e2e/shared", writer_id="late") as late:
            late.apply_deltas(tree("src1"))  # completed before this writer opened: an anomaly
            late.flush()
        answers.append(client.are_completed("e2e/shared", sources))
        for name in ("nemo/trace", "e2e/shared"):
            status = client.checkpoint(name)
            answers.append((name, status.completed_count, status.pending_sources, status.anomalies))
        answers.append(list(client.completed("e2e/shared", page_size=2)))
    return answers


def test_the_same_deltas_answer_the_same_on_postgresql_as_on_lmdb(tmp_path: Path, postgres_url: str) -> None:
    with running_server(tmp_path / "lmdb", settle_ms=0) as server:
        on_lmdb = drive(server)
    with running_server(tmp_path / "pg", settle_ms=0, store=postgres_url) as server:
        on_pg = drive(server)
    assert on_pg == on_lmdb
    assert on_pg[-1] == ["src0", "src2", "src4"]  # src1 un-completed by the anomaly, src3 unfinished
    # Everything lives in PostgreSQL, nothing under the data directory's checkpoints/ nor a journal file.
    rows = sql(
        postgres_url,
        "SELECT convert_from(source_id, 'UTF8'), origin FROM completed WHERE checkpoint = :c ORDER BY 1, 2",
        c="e2e/shared",
    )
    assert rows == [("src0", "task-0"), ("src0", "task-1"), ("src2", "task-0"), ("src4", "task-1")]
    trace = sql(postgres_url, "SELECT count(*) FROM completed WHERE checkpoint = 'nemo/trace'")[0][0]
    assert trace == len(nemo_read(tmp_path / "lmdb" / "checkpoints" / "nemo" / "trace")) > 0
    assert not (tmp_path / "pg" / "checkpoints").exists()
    assert not (tmp_path / "pg" / "journal.log").exists()
    assert not (tmp_path / "pg" / "registry.sqlite3").exists()  # the registry went to the store's database
    assert sql(postgres_url, "SELECT count(*) FROM writers")[0][0] == 4


def lock_is_free(url: str) -> bool:
    held = sql(
        url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid::bigint = :hi AND objid::bigint = :lo",
        hi=STORE_LOCK_KEY >> 32,
        lo=STORE_LOCK_KEY & 0xFFFFFFFF,
    )
    return held[0][0] == 0


@pytest.mark.parametrize("stop", ["term", "kill"])
def test_a_restart_keeps_completions_and_live_writers_carry_on(
    tmp_path: Path, postgres_url: str, stop: str
) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=postgres_url) as first:
        ports = {"grpc_listen": first.grpc_address, "http_listen": first.http_address}
        client = tally.Client(first.grpc_address, timeout=30)
        w = client.writer("pg/restart", writer_id="long-job")
        w.open()
        w.apply_deltas(tree("done"))
        w.apply_deltas(tree("half")[:3])
        w.flush()  # acknowledged: "done" is durable, "half" is pending in the journal
        journaled = sql(postgres_url, "SELECT count(*) FROM journal_entries")[0][0]
        assert journaled > 0
        if stop == "term":
            assert first.terminate() == 0
        else:
            first.kill()
    assert sql(postgres_url, "SELECT convert_from(source_id, 'UTF8') FROM completed") == [("done",)]
    with running_server(data, settle_ms=0, store=postgres_url, **ports) as second:
        with tally.Client(second.grpc_address) as fresh:
            assert fresh.are_completed("pg/restart", ["done", "half"]) == [True, False]
            status = fresh.checkpoint("pg/restart")
            # The writer is back with its pending source.
            assert (status.completed_count, status.pending_sources, status.live_writers) == (1, 1, 1)
        w.apply_deltas(tree("half")[3:])
        w.flush()
        assert not w.health().lease_lost
        assert w.close().incomplete_count == 0
        client.close()
        with tally.Client(second.grpc_address) as fresh:
            assert fresh.are_completed("pg/restart", ["done", "half"]) == [True, True]
            kinds = [e.kind for e in fresh.events("pg/restart", limit=50).events]
            assert "writer_restored" in kinds and "writer_lost" not in kinds
    assert sql(postgres_url, "SELECT count(*) FROM journal_entries")[0][0] == 0  # closed: forgotten
    assert not (data / "checkpoints").exists() and not (data / "journal.log").exists()
    assert lock_is_free(postgres_url)


def test_a_reset_moves_rows_to_the_trash_table(tmp_path: Path, postgres_url: str) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as server,
        httpx.Client(base_url=server.http_url) as http,
        tally.Client(server.grpc_address) as client,
    ):
        with client.writer("pg/reset", writer_id="w1") as w:
            w.apply_deltas(tree("a"))
            w.apply_deltas(tree("b"))
        moved = http.post("/v1/reset", json={"name": "pg/reset"}).json()
        assert moved["files_moved"] == 1 and "completed_trash" in moved["moved_to"]
        assert client.are_completed("pg/reset", ["a", "b"]) == [False, False]
        trashed = sql(
            postgres_url,
            "SELECT convert_from(source_id, 'UTF8'), origin FROM completed_trash "
            "WHERE checkpoint = 'pg/reset' ORDER BY 1",
        )
        assert trashed == [("a", "w1"), ("b", "w1")]
        assert sql(postgres_url, "SELECT count(*) FROM completed WHERE checkpoint = 'pg/reset'")[0][0] == 0
        with client.writer("pg/reset", writer_id="again") as w:  # starts over
            w.apply_deltas(tree("a"))
        assert client.are_completed("pg/reset", ["a", "b"]) == [True, False]
        # The command line says where the rows went, not a folder of the data directory.
        said = subprocess.run(
            [str(Path(sys.executable).with_name("tally")), "reset", "pg/reset", "--yes", "--force"],
            env={**os.environ, "TALLY_ADDRESS": server.grpc_address, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert said.returncode == 0, said.stderr
        assert re.fullmatch(
            r"reset pg/reset: moved the completions of 1 writer to table completed_trash \(checkpoint "
            r"'pg/reset', stamp '\S+'\) in the store; closed 0 live writers\n",
            said.stdout,
        ), said.stdout
        assert client.are_completed("pg/reset", ["a"]) == [False]


def test_a_loaded_checkpoint_answers_from_memory_never_from_the_database(
    tmp_path: Path, postgres_url: str
) -> None:
    """Lookups run on the event loop: once loaded, not one of them may be a database query.

    The table is renamed away under the running coordinator: any lookup that went to the database
    would fail and answer "not completed" (or stall); answers from memory stay right.
    """
    with running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as server:
        with tally.Client(server.grpc_address) as client:
            with client.writer("pg/memory", writer_id="w1") as w:
                w.apply_deltas(tree("a") + tree("b"))
            with client.writer("pg/memory", writer_id="w2") as w:  # another origin
                w.apply_deltas(tree("c"))
    # A new coordinator loads the ids from the database (the first one still had them in memory).
    with running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as server:
        with tally.Client(server.grpc_address) as client:
            assert client.are_completed("pg/memory", ["a", "b", "c", "d"]) == [True, True, True, False]
            ddl(postgres_url, "ALTER TABLE completed RENAME TO completed_away")
            try:
                assert client.are_completed("pg/memory", ["a", "b", "c", "d"]) == [True, True, True, False]
                status = client.checkpoint("pg/memory")
                assert status.completed_count == 3
            finally:
                ddl(postgres_url, "ALTER TABLE completed_away RENAME TO completed")


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    command = [TALLY, "serve", "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_a_second_coordinator_on_the_same_store_serves_as_a_replica_naming_the_owner(
    tmp_path: Path, postgres_url: str
) -> None:
    with (
        running_server(tmp_path / "first", settle_ms=0, store=postgres_url) as first,
        tally.Client(first.grpc_address) as client,
    ):
        with client.writer("pg/shared", writer_id="w1") as w:
            w.apply_deltas(tree("a"))
        # Another data directory (the data-dir lock does not see it): the store's lock is held, so
        # the second serves as a replica of the first instead of refusing to start.
        with running_server(tmp_path / "second", settle_ms=0, store=postgres_url) as second:
            log = second.log()
            assert f"tally serve pid {first.process.pid} on {socket.gethostname()}" in log
            assert "serving as a replica of it" in log
            with tally.Client(second.grpc_address) as through_replica:
                with through_replica.writer("pg/shared", writer_id="w2") as w:
                    w.apply_deltas(tree("b"))
            assert client.are_completed("pg/shared", ["a", "b"]) == [True, True]
            assert first.process.poll() is None
            assert "taking over store" not in second.log()


def test_a_bad_or_unreachable_store_is_a_one_line_startup_error(tmp_path: Path) -> None:
    unreachable = serve("--data-dir", str(tmp_path / "d1"), "--store", "postgresql://tally@127.0.0.1:1/tally")
    assert unreachable.returncode == 1
    (line,) = unreachable.stderr.strip().splitlines()
    assert line.startswith(
        "tally serve: cannot use the PostgreSQL store postgresql+psycopg://tally@127.0.0.1:1/tally"
    )
    assert "Traceback" not in unreachable.stderr
    wrong = serve("--data-dir", str(tmp_path / "d2"), "--store", "mysql://tally@db/tally")
    assert wrong.returncode == 2
    assert "the store runs on PostgreSQL through psycopg 3" in " ".join(
        wrong.stderr.replace("│", " ").split()
    )
    assert "Traceback" not in wrong.stderr


def lock_holder(url: str) -> int | None:
    held = sql(
        url,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid::bigint = :hi AND objid::bigint = :lo",
        hi=STORE_LOCK_KEY >> 32,
        lo=STORE_LOCK_KEY & 0xFFFFFFFF,
    )
    return int(held[0][0]) if held else None


def test_connections_cut_as_by_a_database_restart_change_nothing_for_writers(
    tmp_path: Path, postgres_url: str
) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as server,
        tally.Client(server.grpc_address, timeout=30) as client,
    ):
        w = client.writer("pg/cut", writer_id="w")
        w.open()
        w.apply_deltas(tree("a"))
        w.flush()
        first_holder = lock_holder(postgres_url)
        assert first_holder is not None
        cut = sql(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        assert len(cut) >= 2  # the lock's session and at least one pooled connection
        w.apply_deltas(tree("b"))
        w.flush()
        assert client.are_completed("pg/cut", ["a", "b"]) == [True, True]
        wait_until(
            lambda: lock_holder(postgres_url) not in (None, first_holder),
            timeout=30,
            what="the coordinator took the store's lock again on a new session",
        )
        assert w.close().incomplete_count == 0
        assert server.process.poll() is None
    assert "taking the lock again" in server.log()


def test_a_coordinator_that_lost_the_lock_to_another_stops(tmp_path: Path, postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with (
            running_server(tmp_path / "data", settle_ms=0, store=postgres_url) as server,
            engine.connect() as thief,
        ):
            holder = lock_holder(postgres_url)
            thief.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": holder})
            # Queued behind the ended session, so this gets the lock before the coordinator retries.
            thief.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": STORE_LOCK_KEY})
            wait_until(lambda: server.process.poll() is not None, timeout=30, what="the coordinator stopped")
            assert "lost the store's lock" in server.log()
            assert "is in use by another tally serve" in server.log()
    finally:
        engine.dispose()


def test_after_a_restart_every_completion_is_listed_and_exported_earlier_writers_too(
    tmp_path: Path, postgres_url: str
) -> None:
    """A restarted coordinator loads the checkpoint's ids from the database; the writers that made
    them are not live any more, yet listing (and so ``tally export``) must page through their rows
    too, not only those of writers that completed something since (a bug found through replicas)."""
    with running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as first:
        with tally.Client(first.grpc_address) as client, client.writer("pg/relist", writer_id="w1") as w:
            for source in ("a", "b", "c"):
                w.apply_deltas(tree(source))
    with (
        running_server(tmp_path / "b", settle_ms=0, store=postgres_url) as again,
        tally.Client(again.grpc_address) as client,
    ):
        with client.writer("pg/relist", writer_id="w2") as w:
            for source in ("d", "e"):
                w.apply_deltas(tree(source))
        assert list(client.completed("pg/relist")) == ["a", "b", "c", "d", "e"]
        exported = tmp_path / "exported"
        done = subprocess.run(
            [TALLY, "export", "--address", again.grpc_address, "pg/relist", str(exported)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert nemo_read(exported) == {"a", "b", "c", "d", "e"}
