"""Writers outlive the coordinator (issue 9): a restart, crash or upgrade is only a pause for them.

Real ``tally serve`` processes on one data directory, restarted on the same ports, and real SDK
writers that never reopen.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

import tally
from bench._faultlib import kill9
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.domain.ports import JournalEntry, OpenJournal
from tally_server.store.journal import LMDB_JOURNAL_FILENAME, LmdbJournal
from tally_server.store.journal_log import LOG_FILENAME, LogJournal
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import nemo_read, tree
from tests.polling import wait_until

TTL = 2.0


@pytest.mark.parametrize("settle_ms", [0, 250])
@pytest.mark.parametrize("stop", ["kill", "term"])
def test_writers_carry_on_through_a_restart_without_replay(tmp_path: Path, stop: str, settle_ms: int) -> None:
    """Four writers (two over gRPC, two over HTTP) split every tree across flushes; the coordinator
    is killed (or stopped for an upgrade) at a random moment and started again: every writer
    finishes without being reopened, every fully sent source is completed, nothing else is."""
    for attempt in range(8):  # until the stop comes while writers are still streaming
        result = kill9.run_trial(
            tmp_path / str(attempt), 0, random.Random(attempt), settle_ms, min_rounds=kill9.WRITERS, stop=stop
        )
        if result.writers:
            break
    assert result.same_ports
    assert result.writers > 0, "every writer had finished before the stop: no restart under load"
    ended = result.ended_by
    assert ended.get("finished", 0) + ended.get("done before the kill", 0) == kill9.WRITERS, ended
    assert result.recovered == result.writers, f"{result.recovered} of {result.writers} writers carried on"
    assert not result.lost, f"{len(result.lost)} acknowledged completions lost"
    assert not result.false, f"{len(result.false)} sources completed that were never fully sent"


@contextmanager
def restarted(data: Path, first: RunningServer, **options: object) -> Iterator[RunningServer]:
    ports = {"grpc_listen": first.grpc_address, "http_listen": first.http_address}
    with running_server(data, **ports, **options) as second:  # type: ignore[arg-type]
        yield second


def test_a_restart_longer_than_the_lease_still_lets_writers_back_in(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, lease_ttl_s=TTL) as first:
        client = tally.Client(first.grpc_address, timeout=30)
        writer = client.writer("restart/long", writer_id="patient")
        writer.open()
        writer.apply_deltas(tree("x")[:3])
        writer.flush()
        first.kill()
        # Down for three leases: the lease clock does not run while the coordinator is down.
        down_until = time.monotonic() + 3 * TTL
        while time.monotonic() < down_until:
            time.sleep(0.1)
        with restarted(data, first, settle_ms=0, lease_ttl_s=TTL) as second:
            writer.apply_deltas(tree("x")[3:])
            writer.flush()
            assert writer.close().incomplete_count == 0
            client.close()
            with tally.Client(second.grpc_address) as fresh:
                assert fresh.are_completed("restart/long", ["x"]) == [True]


def test_writers_journaled_in_journal_mdb_by_a_former_tally_carry_on_after_the_upgrade(
    tmp_path: Path,
) -> None:
    """A data directory from before the journal's log: its ``journal.mdb`` is migrated at start,
    and the writers it holds re-attach and finish as after any restart."""
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as first:
        client = tally.Client(first.grpc_address, timeout=30)
        writers = [client.writer("restart/upgrade", writer_id=f"w{i}") for i in range(2)]
        for i, writer in enumerate(writers):
            writer.open()
            writer.apply_deltas(tree(f"x{i}")[:3])
            writer.flush()
        first.kill()
        # What a former Tally would have left: the same journal, in LMDB.
        log_journal = LogJournal(data)
        journaled = log_journal.load()
        log_journal.close()
        assert sorted(w.opened.writer_id for w in journaled) == ["w0", "w1"]
        (data / LOG_FILENAME).unlink()
        lmdb = LmdbJournal(data)
        for w in journaled:
            first_index = w.last_index - len(w.entries) + 1
            lmdb.commit([OpenJournal(w.opened)])
            lmdb.commit([JournalEntry(w.opened.handle, first_index + n, e) for n, e in enumerate(w.entries)])
        lmdb.close()
        with restarted(data, first, settle_ms=0) as second:
            assert not (data / LMDB_JOURNAL_FILENAME).exists() and (data / LOG_FILENAME).exists()
            for i, writer in enumerate(writers):
                writer.apply_deltas(tree(f"x{i}")[3:])
                writer.flush()
                assert writer.close().incomplete_count == 0
            client.close()
            with tally.Client(second.grpc_address) as fresh:
                assert fresh.are_completed("restart/upgrade", ["x0", "x1"]) == [True, True]
                assert fresh.checkpoint("restart/upgrade").live_writers == 0


def test_a_writer_that_really_died_still_expires_a_lease_after_the_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, lease_ttl_s=TTL) as first:
        with httpx.Client(base_url=first.http_url, timeout=10) as http:
            # Raw HTTP: nobody heartbeats for this writer; it dies with the coordinator.
            opened = http.post("/v1/writers", json={"checkpoint": "restart/dead", "writer_id": "gone"})
            assert opened.status_code == 200
        first.kill()
        with restarted(data, first, settle_ms=0, lease_ttl_s=TTL) as second:
            back = time.monotonic()
            with httpx.Client(base_url=second.http_url, timeout=10) as http:
                assert http.get("/v1/checkpoints/restart/dead").json()["live_writers"] == 1  # restored
                wait_until(
                    lambda: http.get("/v1/checkpoints/restart/dead").json()["live_writers"] == 0,
                    timeout=20 * TTL,
                    what="the dead writer expired",
                )
                gone_after = time.monotonic() - back  # at least a lease (and the restart grace)
                events = http.get("/v1/events", params={"checkpoint": "restart/dead"}).json()["events"]
            kinds = [e["kind"] for e in events if e["writer_id"] == "gone"]
            assert kinds[:2] == ["writer_expired", "writer_restored"]
            assert gone_after >= 0.9 * TTL  # a whole lease, counted from the restart


def test_a_batch_sent_again_is_applied_once_and_answered_again(tmp_path: Path) -> None:
    with (
        running_server(tmp_path / "data", settle_ms=0) as server,
        grpc.insecure_channel(server.grpc_address) as channel,
        httpx.Client(base_url=server.http_url, timeout=10) as http,
    ):
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="restart/seq", writer_id="g")).handle

        def grpc_send(seq: int, *deltas: tuple[str, str, int]) -> pb.ApplyCounts:
            items = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in deltas]
            return stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=items, batch_seq=seq)).counts

        first = grpc_send(1, ("a", "x", 1), ("b", "x", 1))
        again = grpc_send(1, ("a", "x", 1), ("b", "x", 1))  # the answer was lost: same batch again
        assert (again.applied, again.skipped) == (first.applied, first.skipped) == (2, 0)
        grpc_send(2, ("c", "x", -1), ("d", "x", -1))
        # Applied twice, x would stand at 2 after its four deltas; once, it is complete.
        done = stub.AreCompleted(pb.AreCompletedRequest(checkpoint="restart/seq", source_ids=["x"]))
        assert list(done.completed) == [True]
        # A batch below the last one applied (resent out of turn, or overtaken by a later one) is
        # refused, not answered as if applied: it changes nothing.
        with pytest.raises(grpc.RpcError) as late:
            grpc_send(1, ("z", "late", 1))
        assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "batch_seq 1 is below the last batch this writer applied (2)" in late.value.details()
        grpc_send(3, ("z2", "late", 1))
        pending = stub.GetCheckpoint(pb.GetCheckpointRequest(name="restart/seq")).pending_sources
        assert pending == 1  # "late" once, from batch 3

        h = http.post("/v1/writers", json={"checkpoint": "restart/seq", "writer_id": "h"}).json()["handle"]
        body = {"batch_seq": 1, "deltas": [{"task_id": "e", "source_id": "y", "delta": 1}]}
        assert http.post(f"/v1/writers/{h}/deltas", json=body).json()["counts"]["applied"] == 1
        assert http.post(f"/v1/writers/{h}/deltas", json=body).json()["counts"]["applied"] == 1
        assert http.get("/v1/checkpoints/restart/seq").json()["pending_sources"] == 2  # late, y
        metrics = http.get("/metrics").text
        assert "tally_batches_resent_total 2.0" in metrics


def test_an_open_retried_with_its_session_token_attaches_even_across_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as first:
        with httpx.Client(base_url=first.http_url, timeout=10) as http:
            body = {"checkpoint": "restart/open", "writer_id": "w", "session_token": "t0ken"}
            handle = http.post("/v1/writers", json=body).json()["handle"]
            assert http.post("/v1/writers", json=body).json()["handle"] == handle
            other = http.post("/v1/writers", json={**body, "session_token": "someone-else"})
            assert other.status_code == 409 and other.json()["error"]["code"] == "ALREADY_EXISTS"
        first.kill()
        with restarted(data, first, settle_ms=0) as second, httpx.Client(base_url=second.http_url) as http:
            assert http.post("/v1/writers", json=body).json()["handle"] == handle


def test_a_journal_stays_bounded_however_long_its_writer_runs(tmp_path: Path) -> None:
    """Snapshots replace a writer's journal entries as it goes, so a writer sending the same work
    over and over (retries) keeps a journal of a few entries, and a restart still rebuilds it."""
    data = tmp_path / "data"
    env = {"TALLY_JOURNAL_SNAPSHOT_DELTAS": "500"}
    with running_server(data, settle_ms=0, env=env) as first:
        client = tally.Client(first.grpc_address)
        writer = client.writer("restart/bounded", writer_id="long")
        writer.open()
        trees = [d for i in range(20) for d in tree(f"s{i}")[:5]]  # 100 deltas, all still pending
        for _ in range(100):  # 10,000 deltas, the same ones: the state never grows
            writer.apply_deltas(trees)
            writer.flush()
        with httpx.Client(base_url=first.http_url) as http:
            metrics = http.get("/metrics").text.splitlines()
        entries = float(
            next(line.split()[-1] for line in metrics if line.startswith("tally_journal_entries "))
        )
        assert entries <= 500 / 100 + 3, entries  # without snapshots: 100 and counting
        first.kill()
        with restarted(data, first, settle_ms=0, env=env) as second:
            for i in range(20):
                writer.apply_deltas(tree(f"s{i}")[5:])
            writer.flush()
            assert writer.close().incomplete_count == 0
            client.close()
            with tally.Client(second.grpc_address) as fresh:
                assert fresh.are_completed("restart/bounded", [f"s{i}" for i in range(20)]) == [True] * 20
    assert len(nemo_read(data / "checkpoints" / "restart" / "bounded")) == 20


def test_a_close_sent_again_is_answered_as_the_first_even_across_a_restart(tmp_path: Path) -> None:
    """A close whose answer was lost (a connection cut, a coordinator killed right after it) is sent
    again by the SDK: it must get the close's answer, not NOT_FOUND, which the SDK reports as a lost
    lease although the writer closed cleanly (found by bench/faults.py kill9, seed 301)."""
    data = tmp_path / "data"
    checkpoint = "restart/close"
    deltas = [("a", "x", 1), ("b", "x", -1), ("c", "y", 1)]  # x completes, y is left incomplete
    body = {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in deltas]}
    with running_server(data, settle_ms=250) as first:
        with httpx.Client(base_url=first.http_url, timeout=10) as http:
            opened = http.post("/v1/writers", json={"checkpoint": checkpoint, "writer_id": "w"})
            handle = opened.json()["handle"]
            assert http.post(f"/v1/writers/{handle}/deltas", json=body).status_code == 200
            closed = http.post(f"/v1/writers/{handle}/close")
            assert closed.status_code == 200, closed.text
            answer = closed.json()
            # x was settling: the close completed it.
            assert answer["counts"]["completed"] == 1 and answer["incomplete_count"] == 1
            assert answer["incomplete_sources"] == ["y"]
            again = http.post(f"/v1/writers/{handle}/close")
            assert (again.status_code, again.json()) == (200, answer)
        with grpc.insecure_channel(first.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            reply = stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
            assert (reply.counts.applied, reply.counts.completed, reply.incomplete_count) == (3, 1, 1)
            assert list(reply.incomplete_sources) == ["y"]
        first.kill()  # right after the close: its journal is gone, the writer is not restored
    with restarted(data, first, settle_ms=250) as second:
        with httpx.Client(base_url=second.http_url, timeout=10) as http:
            assert http.get(f"/v1/checkpoints/{checkpoint}").json()["live_writers"] == 0
            after = http.post(f"/v1/writers/{handle}/close")
            assert after.status_code == 200, after.text
            # From the writer's registry row: the counts and how many were left incomplete.
            assert after.json() == {**answer, "incomplete_sources": []}
            unknown = http.post("/v1/writers/0123456789abcdef0123456789abcdef/close")
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
            # Deltas for the closed writer are still refused: only its close is answered again.
            refused = http.post(f"/v1/writers/{handle}/deltas", json=body)
            assert refused.status_code == 404
        with grpc.insecure_channel(second.grpc_address) as channel:
            reply = pb_grpc.CoordinatorStub(channel).CloseWriter(pb.CloseWriterRequest(handle=handle))
            assert (reply.counts.applied, reply.counts.completed, reply.incomplete_count) == (3, 1, 1)
        with tally.Client(second.grpc_address) as client:
            assert client.are_completed(checkpoint, ["x", "y"]) == [True, False]


def test_a_writer_whose_lease_ran_out_is_still_unknown_to_a_late_close(tmp_path: Path) -> None:
    """Only closes by the writer's client are answered again: a close for a writer whose lease ran
    out (its pending state dropped) still says NOT_FOUND, before and after a restart."""
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, lease_ttl_s=TTL) as first:
        with httpx.Client(base_url=first.http_url, timeout=10) as http:
            opened = http.post("/v1/writers", json={"checkpoint": "restart/late", "writer_id": "late"})
            handle = opened.json()["handle"]
            wait_until(
                lambda: http.get("/v1/checkpoints/restart/late").json()["live_writers"] == 0,
                timeout=20 * TTL,
                what="the silent writer expired",
            )
            late = http.post(f"/v1/writers/{handle}/close")
            assert late.status_code == 404 and late.json()["error"]["code"] == "NOT_FOUND"
        first.terminate()  # graceful: the expired writer's registry row is written before it exits
    with restarted(data, first, settle_ms=0, lease_ttl_s=TTL) as second:
        with httpx.Client(base_url=second.http_url, timeout=10) as http:
            late = http.post(f"/v1/writers/{handle}/close")
            assert late.status_code == 404 and late.json()["error"]["code"] == "NOT_FOUND"
