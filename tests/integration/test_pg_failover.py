"""A standby coordinator on the same PostgreSQL store takes over when the one serving it goes.

Issue #11's failover, with one coordinator serving a store at a time: the standby listens on no
port until it holds the store's lock, then serves with the writers' journals, so a writer carries on
with the same handle; kill -9 and SIGTERM of the active one lose nothing acknowledged and apply
nothing twice.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import sqlalchemy as sa

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.conftest import free_ports
from tests.integration.raw import deltas
from tests.integration.workload import tree
from tests.polling import wait_until

pytestmark = pytest.mark.postgres

TALLY = str(Path(sys.executable).parent / "tally")


@contextlib.contextmanager
def standby(data: Path, url: str, **listen: str) -> Iterator[Future[RunningServer]]:
    """``tally serve --standby`` started in the background: the future resolves once it serves."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        yield pool.submit(
            stack.enter_context,
            running_server(data, settle_ms=0, store=url, args=["--standby"], startup_timeout=120, **listen),
        )


def waiting(data: Path) -> bool:
    log = data / "tally-serve.log"
    return log.exists() and "standby: " in log.read_text(errors="replace")


@pytest.mark.parametrize("how", ["kill", "term"])
def test_the_standby_takes_over_and_the_writer_carries_on_with_its_handle(
    tmp_path: Path, postgres_url: str, how: str
) -> None:
    sources = [f"s{i}" for i in range(8)]
    with running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as active:
        with standby(tmp_path / "b", postgres_url) as later:
            wait_until(lambda: waiting(tmp_path / "b"), what="the standby waiting for the store", timeout=60)
            assert not later.done()  # it does not serve while the active one does
            with grpc.insecure_channel(active.grpc_address) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="ha/run", writer_id="w")).handle
                for seq, source in enumerate(sources[:4], start=1):
                    stub.ApplyDeltas(
                        pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree(source)), batch_seq=seq)
                    )
                # A source left half done: its pending count must survive the failover.
                half = pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("half")[:3]), batch_seq=5)
                stub.ApplyDeltas(half)
            if how == "kill":
                active.kill()
            else:
                assert active.terminate() == 0
            took_over = later.result(120)
            assert "taking over store" in took_over.log()
            with grpc.insecure_channel(took_over.grpc_address) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                done = stub.AreCompleted(
                    pb.AreCompletedRequest(checkpoint="ha/run", source_ids=sources[:4] + ["half"])
                )
                assert list(done.completed) == [True] * 4 + [False]
                # The last batch sent again (its answer was lost): recognised, not applied twice.
                again = stub.ApplyDeltas(half)
                assert again.counts.applied == 3 and again.counts.completed == 0
                rest = tree("half")[3:]
                finished = stub.ApplyDeltas(
                    pb.ApplyDeltasRequest(handle=handle, deltas=deltas(rest), batch_seq=6)
                )
                assert finished.counts.completed == 1  # the pending count came over: -1s finish it
                for seq, source in enumerate(sources[4:], start=7):
                    stub.ApplyDeltas(
                        pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree(source)), batch_seq=seq)
                    )
                closed = stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
                assert closed.incomplete_count == 0
                every = stub.AreCompleted(
                    pb.AreCompletedRequest(checkpoint="ha/run", source_ids=[*sources, "half"])
                )
                assert all(every.completed)
                status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="ha/run"))
                assert status.completed_count == len(sources) + 1 and status.anomalies == 0


def test_a_standby_stopped_before_taking_over_exits_cleanly_and_serves_nothing(
    tmp_path: Path, postgres_url: str
) -> None:
    with running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as active:
        data = tmp_path / "b"
        data.mkdir()
        with open(data / "tally-serve.log", "w") as log:
            command = [TALLY, "serve", "--data-dir", str(data), "--store", postgres_url, "--standby"]
            command += ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
            waiting_one = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
            try:
                wait_until(lambda: waiting(data), what="the standby waiting for the store", timeout=60)
                waiting_one.send_signal(signal.SIGTERM)
                out, _ = waiting_one.communicate(timeout=60)
            finally:
                if waiting_one.poll() is None:
                    waiting_one.kill()
        assert waiting_one.returncode == 0
        assert "listening" not in out  # it never served
        assert "standby stopped before taking over" in (data / "tally-serve.log").read_text()
        # The active one never noticed.
        with grpc.insecure_channel(active.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="ha/still", writer_id="w")).handle
            stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("a"))))
            assert stub.AreCompleted(
                pb.AreCompletedRequest(checkpoint="ha/still", source_ids=["a"])
            ).completed == [True]


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_an_sdk_writer_given_both_addresses_rides_through_a_kill_9_of_the_active_one(
    tmp_path: Path, postgres_url: str, scheme: str
) -> None:
    grpc_port, http_port = free_ports(2)  # the standby's, known before it listens
    listen = {"grpc_listen": f"127.0.0.1:{grpc_port}", "http_listen": f"127.0.0.1:{http_port}"}
    sources = [f"s{i}" for i in range(40)]
    with running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as active:
        with standby(tmp_path / "b", postgres_url, **listen) as later:
            wait_until(lambda: waiting(tmp_path / "b"), what="the standby waiting for the store", timeout=60)
            if scheme == "grpc":
                both = f"{active.grpc_address},127.0.0.1:{grpc_port}"
            else:
                both = f"{active.http_url},http://127.0.0.1:{http_port}"
            with tally.Client(both, timeout=60) as client, client.writer("ha/sdk", writer_id="w") as w:
                for source in sources[:20]:
                    w.apply_deltas(tree(source))
                w.apply_deltas(tree("half")[:3])
                w.flush()  # acknowledged: the first 20 are durable, "half" is pending in the journal
                active.kill()
                for source in sources[20:]:
                    w.apply_deltas(tree(source))  # buffered and resent until the standby serves
                w.apply_deltas(tree("half")[3:])
                w.flush()
                assert later.result(120).grpc_address == f"127.0.0.1:{grpc_port}"
                health = w.health()
                assert not health.lease_lost and health.buffered == 0
                assert client.are_completed("ha/sdk", [*sources, "half"]) == [True] * (len(sources) + 1)
                status = client.checkpoint("ha/sdk")
                assert status.completed_count == len(sources) + 1 and status.anomalies == 0


def test_standby_without_a_store_is_refused_saying_why(tmp_path: Path) -> None:
    command = [TALLY, "serve", "--data-dir", str(tmp_path / "data"), "--standby"]
    command += ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_without_tally_env())
    assert done.returncode == 2 and "listening" not in done.stdout
    assert "standby needs store" in done.stderr and "give --store too" in done.stderr


def _without_tally_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}


def test_a_paused_coordinator_is_taken_over_and_stops_when_it_resumes(
    tmp_path: Path, postgres_url: str
) -> None:
    """SIGSTOP keeps the paused one's database session (and lock): it stops renewing, so the standby
    ends that session and takes over; resumed, the paused one finds the store taken and stops."""
    grpc_port, http_port = free_ports(2)
    listen = {"grpc_listen": f"127.0.0.1:{grpc_port}", "http_listen": f"127.0.0.1:{http_port}"}
    sources = [f"s{i}" for i in range(30)]
    with running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as active:
        with standby(tmp_path / "b", postgres_url, **listen) as later:
            wait_until(lambda: waiting(tmp_path / "b"), what="the standby waiting for the store", timeout=60)
            both = f"{active.grpc_address},127.0.0.1:{grpc_port}"
            # Calls to the paused one get no answer: each attempt gives up after 5 s and moves on.
            with tally.Client(both, timeout=5) as client, client.writer("ha/pause", writer_id="w") as w:
                for source in sources[:15]:
                    w.apply_deltas(tree(source))
                w.flush()
                active.process.send_signal(signal.SIGSTOP)
                try:
                    took_over = later.result(120)
                    for source in sources[15:]:
                        w.apply_deltas(tree(source))
                    w.flush(timeout=120)
                finally:
                    active.process.send_signal(signal.SIGCONT)
                assert "has not shown it is alive" in took_over.log()
                # Resumed, the paused coordinator finds the store taken over and stops by itself.
                assert active.process.wait(60) == 0
                assert "lost the store's lock" in active.log()
                # What it still tried to write (its live writer's journal, at least on its way out)
                # was refused by the epoch.
                assert "no longer owns the PostgreSQL store" in active.log()
                assert not w.health().lease_lost
                assert client.are_completed("ha/pause", sources) == [True] * len(sources)
                status = client.checkpoint("ha/pause")
                assert status.completed_count == len(sources) and status.anomalies == 0


def test_reads_wait_while_the_coordinator_cannot_confirm_it_still_serves_the_store(
    tmp_path: Path, postgres_url: str
) -> None:
    """A check of the store's lock that hangs (here: a table lock; in life, a database gone silent)
    leaves the coordinator unsure it still serves the store: a standby may take over meanwhile and
    change completions, so reads of them are refused until a check succeeds again."""
    with (
        running_server(tmp_path / "a", settle_ms=0, store=postgres_url) as server,
        tally.Client(server.grpc_address, timeout=2) as client,
    ):
        with client.writer("ha/contact", writer_id="w") as w:
            w.apply_deltas(tree("a"))
        assert client.are_completed("ha/contact", ["a"]) == [True]
        engine = sa.create_engine(postgres_url)
        try:
            with engine.connect() as conn:
                held = conn.begin()
                conn.execute(sa.text("LOCK TABLE store_epoch IN ACCESS EXCLUSIVE MODE"))  # checks hang
                try:
                    wait_until(lambda: not ready(server), timeout=30, what="/readyz to say not ready")
                    assert (
                        "no contact with the store's database" in httpx.get(f"{server.http_url}/readyz").text
                    )
                    with pytest.raises(tally.Unavailable, match="cannot answer for completions now"):
                        client.are_completed("ha/contact", ["a"])
                finally:
                    held.rollback()
        finally:
            engine.dispose()
        wait_until(lambda: ready(server), timeout=30, what="/readyz to say ready again")
        assert client.are_completed("ha/contact", ["a"]) == [True]
    assert "answering reads again" in server.log()


def ready(server: RunningServer) -> bool:
    return httpx.get(f"{server.http_url}/readyz", timeout=5).status_code == 200
