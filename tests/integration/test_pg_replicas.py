"""Several ``tally serve`` on one PostgreSQL store serve as one service (issue #11's replicas).

The first to start owns the store and applies every writer's deltas; the others serve at once as
replicas: they answer ``are_completed`` from the database and forward every other call (gRPC and
HTTP) to the owner. When the owner goes, one of them takes the store over on the same ports and the
writers carry on through any replica. Every server here is a real ``tally serve`` process on a
fresh database.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

import tally
from tally._transport import failover
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree

pytestmark = pytest.mark.postgres

TALLY = str(Path(sys.executable).parent / "tally")


def tally_cli(*args: str) -> str:
    done = subprocess.run([TALLY, *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def serving_as_replica(server: RunningServer) -> bool:
    return "serving as a replica" in server.log()


@contextlib.contextmanager
def replicas(tmp_path: Path, url: str, n: int, **options: object) -> Iterator[list[RunningServer]]:
    """``n`` coordinators on one store: the first owns it (started first), the others are replicas."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running_server(tmp_path / "r0", store=url, **options))]  # type: ignore[arg-type]
        for i in range(1, n):
            server = stack.enter_context(running_server(tmp_path / f"r{i}", store=url, **options))  # type: ignore[arg-type]
            assert serving_as_replica(server), server.log()
            servers.append(server)
        yield servers


def test_a_replica_forwards_a_writer_to_the_owner_and_answers_reads_itself(
    tmp_path: Path, postgres_url: str
) -> None:
    with replicas(tmp_path, postgres_url, 2, settle_ms=0) as (owner, replica):
        with tally.Client(replica.grpc_address) as client:
            with client.writer("rep/run", writer_id="w1") as w:
                for source in ("a", "b", "c"):
                    w.apply_deltas(tree(source))
                w.apply_deltas(tree("half")[:3])
                w.flush()
                # Read back through the replica: answered from the database, flushed means seen.
                assert client.are_completed("rep/run", ["a", "b", "c", "half", "never"]) == [
                    True,
                    True,
                    True,
                    False,
                    False,
                ]
                # The writer's state lives at the owner: its status (read through the replica) shows it.
                status = client.checkpoint("rep/run")
                assert status.completed_count == 3 and [x.writer_id for x in status.writers] == ["w1"]
            # Who owns what, asked through either: the owner applies this checkpoint's deltas.
            listed = client.replicas()
            assert [r.owner for r in listed.replicas].count(True) == 1
            owner_name = listed.owner.name if listed.owner is not None else ""
            assert {r.grpc_address for r in listed.replicas} == {owner.grpc_address, replica.grpc_address}
            assert listed.owner is not None and listed.owner.grpc_address == owner.grpc_address
            assert listed.answered_by != owner_name and listed.epoch == 1  # answered by the replica
            assert client.checkpoint("rep/run").owner == owner_name
        with tally.Client(owner.grpc_address) as direct:
            assert direct.replicas().answered_by == owner_name
        over_http = httpx.get(f"http://{replica.http_address}/v1/replicas").json()
        assert over_http["answered_by"] != owner_name and len(over_http["replicas"]) == 2
        assert httpx.get(f"http://{owner.http_address}/v1/replicas").json()["answered_by"] == owner_name
        # The operator's view, in a pipe: every replica by name, the owner marked, the epoch.
        shown = tally_cli("replicas", "--address", replica.grpc_address)
        assert owner_name in shown and "owner" in shown and "store epoch 1" in shown
        assert f"owner: {owner_name}" in tally_cli("status", "--address", replica.grpc_address)
        # -o json: the store as one object; -o wide: the start time in full and the silence in seconds.
        store = json.loads(tally_cli("replicas", "-o", "json", "--address", replica.grpc_address))
        assert store["epoch"] == 1 and store["answered_by"] != owner_name
        assert [r["name"] for r in store["replicas"] if r["owner"]] == [owner_name]
        assert all(isinstance(r["started_at"], float) for r in store["replicas"])
        wide = tally_cli("replicas", "-o", "wide", "--address", replica.grpc_address)
        assert "started at" in wide and "silent s" in wide and "store epoch 1" in wide
        (checkpoint,) = json.loads(tally_cli("status", "-o", "json", "--address", replica.grpc_address))
        assert checkpoint["owner"] == owner_name
        # The owner counted the replica's reads nowhere: it answered the forwarded calls only.
        forwarded = httpx.get(f"http://{replica.http_address}/metrics").text
        assert "tally_replica_are_completed_calls_total 1.0" in forwarded
        assert 'outcome="ok",transport="grpc"' in forwarded
        owner_line = next(line for line in forwarded.splitlines() if line.startswith("tally_replica_up{"))
        assert 'owner="' in owner_line and 'owner=""' not in owner_line
        ready = httpx.get(f"http://{replica.http_address}/readyz")
        assert ready.status_code == 200 and ready.json()["role"] == "replica"
        # HTTP is forwarded as it came: the owner's JSON answer, through the replica's port.
        listed = httpx.get(f"http://{replica.http_address}/v1/checkpoints/rep%2Frun")
        assert listed.status_code == 200, listed.text
        assert listed.json()["completed_count"] == 3
        assert "tally_replica_up" not in httpx.get(f"http://{owner.http_address}/metrics").text


def test_refusals_at_the_owner_come_back_through_the_replica_unchanged(
    tmp_path: Path, postgres_url: str
) -> None:
    with replicas(tmp_path, postgres_url, 2) as (owner, replica):
        with (
            grpc.insecure_channel(replica.grpc_address) as channel,
            grpc.insecure_channel(owner.grpc_address) as owner_channel,
        ):
            stub, at_owner = pb_grpc.CoordinatorStub(channel), pb_grpc.CoordinatorStub(owner_channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ApplyDeltas(
                    pb.ApplyDeltasRequest(handle="no-such-handle", deltas=[]),
                    metadata=[("x-request-id", "req-42")],
                )
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "no-such-handle" in refused.value.details() or "writer" in refused.value.details()
            trailers = dict(refused.value.trailing_metadata() or ())
            assert trailers.get("x-request-id") == "req-42"
            # The standard details (grpc-status-details-bin) come through byte for byte.
            with pytest.raises(grpc.RpcError) as direct:
                at_owner.ApplyDeltas(pb.ApplyDeltasRequest(handle="no-such-handle", deltas=[]))
            details_bin = dict(direct.value.trailing_metadata() or ())["grpc-status-details-bin"]
            assert trailers["grpc-status-details-bin"] == details_bin
            assert error_info(refused.value).reason == "NOT_FOUND"
            # A refusal with details: both the JSON trailer and the ErrorInfo metadata survive.
            stub.OpenWriter(pb.OpenWriterRequest(checkpoint="busy", writer_id="w1"))
            with pytest.raises(grpc.RpcError) as busy:
                stub.ResetCheckpoint(pb.ResetCheckpointRequest(name="busy"))
            with pytest.raises(grpc.RpcError) as busy_at_owner:
                at_owner.ResetCheckpoint(pb.ResetCheckpointRequest(name="busy"))
            assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            relayed, sent = (dict(e.value.trailing_metadata() or ()) for e in (busy, busy_at_owner))
            for key in ("grpc-status-details-bin", "tally-error-details"):
                assert relayed[key] == sent[key]
            assert dict(error_info(busy.value).metadata) == {"live_writers": "1"}
            # Validated at the replica itself (answered from the database, never forwarded).
            with pytest.raises(grpc.RpcError) as invalid:
                stub.AreCompleted(pb.AreCompletedRequest(checkpoint="", source_ids=["a"]))
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(invalid.value).metadata["field"] == "checkpoint"


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a failed call's standard Status (whose code and message match the call's)."""
    status = rpc_status.from_call(err)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert [d.Unpack(info) for d in status.details if d.Is(info.DESCRIPTOR)] == [True]
    return info


def test_a_replica_checks_tokens_itself_for_reads_and_the_owner_checks_forwarded_calls(
    tmp_path: Path, postgres_url: str
) -> None:
    tokens = {"TALLY_TOKENS": "w-token:worker,r-token:reader@team-a/"}
    with replicas(tmp_path, postgres_url, 2, env=tokens) as (_owner, replica):
        with grpc.insecure_channel(replica.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            request = pb.AreCompletedRequest(checkpoint="team-b/run", source_ids=["a"])
            with pytest.raises(grpc.RpcError) as anonymous:
                stub.AreCompleted(request)
            assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as scoped:
                stub.AreCompleted(request, metadata=[("authorization", "Bearer r-token")])
            assert scoped.value.code() == grpc.StatusCode.PERMISSION_DENIED
            ok = stub.AreCompleted(
                pb.AreCompletedRequest(checkpoint="team-a/run", source_ids=["a"]),
                metadata=[("authorization", "Bearer r-token")],
            )
            assert list(ok.completed) == [False]
            with pytest.raises(grpc.RpcError) as reader_writes:
                stub.OpenWriter(
                    pb.OpenWriterRequest(checkpoint="team-a/run", writer_id="w"),
                    metadata=[("authorization", "Bearer r-token")],
                )
            assert reader_writes.value.code() == grpc.StatusCode.PERMISSION_DENIED
            opened = stub.OpenWriter(
                pb.OpenWriterRequest(checkpoint="team-a/run", writer_id="w"),
                metadata=[("authorization", "Bearer w-token")],
            )
            assert opened.handle
        # Over HTTP a 401 challenges for a bearer token, whether the replica answers it (its own
        # /v1/replicas) or forwards it to the owner, and a forwarded 405 keeps its Allow header.
        with httpx.Client(base_url=f"http://{replica.http_address}") as http:
            for path in ("/v1/replicas", "/v1/checkpoints"):
                refused = http.get(path)
                assert refused.status_code == 401, path
                assert refused.headers["www-authenticate"] == 'Bearer realm="tally"', path
            wrong = http.delete("/v1/checkpoints", headers={"authorization": "Bearer r-token"})
            assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_when_the_owner_goes_a_replica_takes_over_and_writers_on_every_replica_lose_nothing(
    tmp_path: Path, postgres_url: str, how: signal.Signals
) -> None:
    """Writers through both replicas, the owner killed midway: the final set is exactly the model's."""
    rng = random.Random(7)
    with replicas(tmp_path, postgres_url, 3, settle_ms=0, lease_ttl_s=30) as servers:
        owner, *others = servers
        addresses = ",".join(s.grpc_address for s in others)
        sources = [f"src-{i:03d}" for i in range(60)]
        with tally.Client(addresses) as client:
            writers = [client.writer("rep/fail", writer_id=f"w{i}") for i in range(2)]
            for w in writers:
                w.__enter__()
            done: set[str] = set()
            for i, source in enumerate(sources):
                w = writers[i % 2]
                if i == 25:
                    for ww in writers:
                        ww.flush()
                    owner.process.send_signal(how)
                    owner.process.wait(60)
                deltas = tree(source)
                if rng.random() < 0.2:
                    w.apply_deltas(deltas[:2])  # left pending: never completed
                else:
                    w.apply_deltas(deltas)
                    done.add(source)
            for w in writers:
                w.flush()
            assert client.are_completed("rep/fail", sources) == [s in done for s in sources]
            for w in writers:
                w.__exit__(None, None, None)
            status = client.checkpoint("rep/fail")
            assert status.completed_count == len(done) and status.anomalies == 0
            after = client.replicas()
            assert after.epoch == 2 and after.owner is not None
            assert after.owner.grpc_address in {s.grpc_address for s in others}
            assert status.owner == after.owner.name
        took = [s for s in others if "taking over store" in s.log()]
        assert len(took) == 1, [s.log()[-2000:] for s in others]


def test_a_replica_stopped_and_a_paused_owner_cost_the_writers_on_each_replica_nothing(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers enter through each of three replicas. SIGTERM one replica: its writer moves on. SIGSTOP
    the owner past its lease: a replica ends its session and takes over; SIGCONT: the paused owner
    finds the store taken, its writes are refused by the epoch, and it stops. The final set is the
    model's."""
    sources = [f"p{i:03d}" for i in range(48)]
    with replicas(tmp_path, postgres_url, 3, settle_ms=0) as servers:
        owner, b, c = servers
        every = [s.grpc_address for s in servers]
        # Each writer starts at "its" replica (the first listed), with the others to move to.
        monkeypatch.setattr(failover, "first_replica", lambda count: 0)
        clients = [
            tally.Client(",".join([s.grpc_address] + [x for x in every if x != s.grpc_address]), timeout=5)
            for s in servers
        ]
        try:
            writers = [cl.writer("rep/pause", writer_id=f"w{i}") for i, cl in enumerate(clients)]
            for w in writers:
                w.__enter__()
            for i, source in enumerate(sources[:12]):
                writers[i % 3].apply_deltas(tree(source))
            assert c.terminate() == 0  # a replica stopped cleanly: nothing of it was the owner's
            assert "taking over store" not in c.log()
            for i, source in enumerate(sources[12:24]):
                writers[i % 3].apply_deltas(tree(source))
            for w in writers:
                w.flush(timeout=120)
            owner.process.send_signal(signal.SIGSTOP)
            try:
                for i, source in enumerate(sources[24:]):
                    writers[i % 3].apply_deltas(tree(source))
                for w in writers:
                    w.flush(timeout=120)
            finally:
                owner.process.send_signal(signal.SIGCONT)
            assert "taking over store" in b.log() and "has not shown it is alive" in b.log()
            assert owner.process.wait(60) == 0
            assert "lost the store's lock" in owner.log()
            assert "no longer owns the PostgreSQL store" in owner.log()
            for w in writers:
                assert not w.health().lease_lost
                w.__exit__(None, None, None)
            with tally.Client(b.grpc_address) as survivor:
                assert survivor.are_completed("rep/pause", sources) == [True] * len(sources)
                status = survivor.checkpoint("rep/pause")
                assert status.completed_count == len(sources) and status.anomalies == 0
                assert survivor.replicas().epoch == 2
        finally:
            for client in clients:
                client.close()


def test_a_flushed_completion_is_seen_at_once_through_every_replica(
    tmp_path: Path, postgres_url: str
) -> None:
    """Reads are spread over the replicas (each are_completed to the next one); whichever answers,
    a completion is there as soon as the flush that made it durable returned, and a source whose
    last delta is not sent yet is never reported completed."""
    with replicas(tmp_path, postgres_url, 3) as servers:
        addresses = ",".join(s.grpc_address for s in servers)
        with tally.Client(addresses) as client, client.writer("rep/reads", writer_id="w") as w:
            for i in range(12):
                source = f"r{i}"
                deltas = tree(source)
                w.apply_deltas(deltas[:-1])
                assert client.are_completed("rep/reads", [source] * 3) == [False] * 3
                w.apply_deltas(deltas[-1:])
                w.flush()
                assert client.are_completed("rep/reads", [source] * 3) == [True] * 3
        for replica in servers[1:]:
            metrics = httpx.get(f"http://{replica.http_address}/metrics").text
            answered = next(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("tally_replica_are_completed_calls_total")
            )
            assert answered >= 8  # a third of the 24 reads each, give or take where the count started


def test_a_second_coordinator_under_a_live_ones_name_is_refused_and_no_call_goes_round(
    tmp_path: Path, postgres_url: str
) -> None:
    """Two live coordinators under one replica name would forward to each other for ever: the second
    is refused at start, in one line; and a call a replica already forwarded is never forwarded again."""
    with replicas(tmp_path, postgres_url, 2) as (owner, replica):
        with tally.Client(replica.grpc_address) as client:
            taken = next(r.name for r in client.replicas().replicas if not r.owner)
        done = subprocess.run(
            [TALLY, "serve", "--data-dir", str(tmp_path / "dup"), "--store", postgres_url,
             "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
            env={**os.environ, "TALLY_REPLICA_NAME": taken},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode != 0
        (line,) = done.stderr.strip().splitlines()
        assert "goes by the replica name" in line and "TALLY_REPLICA_NAME" in line
        # A call marked as forwarded already is refused by a replica, naming both.
        looped = httpx.get(
            f"http://{replica.http_address}/v1/checkpoints", headers={"tally-forwarded-by": "elsewhere"}
        )
        assert looped.status_code == 503
        assert "replica elsewhere forwarded this call" in looped.json()["error"]["message"]
        with grpc.insecure_channel(replica.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as again:
                pb_grpc.CoordinatorStub(channel).ListCheckpoints(
                    pb.ListCheckpointsRequest(), metadata=[("tally-forwarded-by", "elsewhere")]
                )
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        # The owner serves such a call as any other (it does not forward).
        assert (
            httpx.get(
                f"http://{owner.http_address}/v1/checkpoints", headers={"tally-forwarded-by": "x"}
            ).status_code
            == 200
        )
