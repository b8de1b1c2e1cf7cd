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
from tests.polling import wait_until

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
                # The writer's state lives at the owner, which publishes it for the replicas within
                # about half a second: read through the replica, the status shows it.
                wait_until(
                    lambda: client.checkpoint("rep/run").completed_count == 3,
                    timeout=30,
                    what="the replica to show the published status",
                )
                status = client.checkpoint("rep/run")
                assert [x.writer_id for x in status.writers] == ["w1"]
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
        # A read over HTTP is answered by the replica in the owner's JSON shape.
        listed = httpx.get(f"http://{replica.http_address}/v1/checkpoints/rep%2Frun")
        assert listed.status_code == 200, listed.text
        assert listed.json()["completed_count"] == 3
        # Other HTTP requests are forwarded as they came: the owner's JSON answer, through the replica.
        fenced = httpx.get(
            f"http://{replica.http_address}/v1/claims/current",
            params={"checkpoint": "rep/run", "source_id": "a", "token": 1},
        )
        assert fenced.status_code == 200 and fenced.json()["current"] is False, fenced.text
        owners = httpx.get(f"http://{owner.http_address}/metrics").text
        assert "tally_replica_up" not in owners
        assert "tally_store_lease_renew_seconds_count" in owners  # its lock's renewals, one a second
        assert "tally_store_lease_renew_seconds_bucket" in owners  # what TallyStoreLeaseRenewalSlow reads
        assert "tally_store_lease_renew_seconds" not in forwarded  # a replica renews no lock


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
            # The status reads a replica answers itself check tokens as the owner does.
            for call, asked in (
                (stub.GetCheckpoint, pb.GetCheckpointRequest(name="team-b/run")),
                (stub.ListEvents, pb.ListEventsRequest(checkpoint="team-b/run")),
                (stub.ListCompleted, pb.ListCompletedRequest(checkpoint="team-b/run")),
            ):
                with pytest.raises(grpc.RpcError) as unknown:
                    call(asked)
                assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as outside:
                    call(asked, metadata=[("authorization", "Bearer r-token")])
                assert outside.value.code() == grpc.StatusCode.PERMISSION_DENIED
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
            # Through a replica, the status is the owner's as published (within about half a second).
            wait_until(
                lambda: client.checkpoint("rep/fail").completed_count == len(done),
                timeout=30,
                what="the status to show every completion",
            )
            status = client.checkpoint("rep/fail")
            assert status.anomalies == 0
            after = client.replicas()
            assert after.epoch == 2 and after.owner is not None
            assert after.owner.grpc_address in {s.grpc_address for s in others}
            assert status.owner == after.owner.name
        took = [s for s in others if "taking over store" in s.log()]
        assert len(took) == 1, [s.log()[-2000:] for s in others]


def test_a_stop_asked_while_a_replica_takes_the_store_over_is_not_lost(
    tmp_path: Path, postgres_url: str
) -> None:
    """SIGTERM the owner, then SIGTERM the replica the moment it says it is taking the store over:
    its replica's servers are closing and the coordinator is not up yet. The stop is kept: the
    coordinator comes up and shuts down gracefully at once (exit 0). Found in a test's teardown
    under load: the replica's own handlers were gone by then (the default action killed it) or
    the stop they had recorded was dropped (it served on, 60 s until the test killed it)."""
    with replicas(tmp_path, postgres_url, 2, settle_ms=0) as (owner, replica):
        assert owner.terminate() == 0  # lets the store go: the replica takes it at once
        wait_until(lambda: "taking over store" in replica.log(), timeout=30, what="the takeover", every=0.002)
        replica.process.send_signal(signal.SIGTERM)
        try:
            code = replica.process.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, replica.log()[-3000:]
        assert "shutdown complete" in replica.log()


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
        # It waited to see whether the name was renewed (a coordinator that died under it would not
        # renew it), saw it renewed, and was refused in one line.
        *waited, line = done.stderr.strip().splitlines()
        assert len(waited) == 1 and "waiting" in waited[0] and "for it to be free" in waited[0]
        assert "goes by the replica name" in line and "TALLY_REPLICA_NAME" in line
        # A call marked as forwarded already is refused by a replica, naming both.
        looped = httpx.get(
            f"http://{replica.http_address}/v1/failures",
            params={"checkpoint": "any"},
            headers={"tally-forwarded-by": "elsewhere"},
        )
        assert looped.status_code == 503
        assert "replica elsewhere forwarded this call" in looped.json()["error"]["message"]
        with grpc.insecure_channel(replica.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as again:
                pb_grpc.CoordinatorStub(channel).ListFailures(
                    pb.ListFailuresRequest(checkpoint="any"), metadata=[("tally-forwarded-by", "elsewhere")]
                )
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
            # A method tally.v1 does not have is not forwarded either: UNIMPLEMENTED, as at the owner.
            metrics_url = f"http://{replica.http_address}/metrics"
            forwarded_before = samples_of(httpx.get(metrics_url).text, "tally_replica_forwarded_calls_total")
            for address in (replica.grpc_address, owner.grpc_address):
                with grpc.insecure_channel(address) as other:
                    unknown = other.unary_unary("/tally.v1.Coordinator/NoSuchCall")
                    with pytest.raises(grpc.RpcError) as missing:
                        unknown(b"", timeout=10)
                    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED, address
            forwarded = samples_of(httpx.get(metrics_url).text, "tally_replica_forwarded_calls_total")
            assert forwarded == forwarded_before
        # The owner serves such a call as any other (it does not forward).
        assert (
            httpx.get(
                f"http://{owner.http_address}/v1/checkpoints", headers={"tally-forwarded-by": "x"}
            ).status_code
            == 200
        )


def samples_of(metrics_text: str, name: str) -> dict[str, float]:
    """The samples of one metric in a Prometheus exposition, by their label text."""
    found = {}
    for line in metrics_text.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, _, value = line[len(name) :].rpartition(" ")
            found[labels] = float(value)
    return found


def test_a_coordinator_killed_and_started_again_at_once_under_its_name_serves_again(
    tmp_path: Path, postgres_url: str
) -> None:
    """kill -9, then the same replica name started again at once (systemd's Restart=, a StatefulSet's
    pod): the row its dead process renewed a moment ago must not refuse the new one; it waits the name
    out and serves, its writer re-attaching without losing what it flushed."""
    name = ["--replica-name", "tally-0"]
    with running_server(tmp_path / "a", store=postgres_url, settle_ms=0, args=name) as first:
        client = tally.Client(first.grpc_address, timeout=60)
        writer = client.writer("crash/name", writer_id="w")
        writer.open()
        writer.apply_deltas(tree("before"))
        writer.flush()
        grpc_listen, http_listen = first.grpc_address, first.http_address
        first.kill()
    try:
        with running_server(
            tmp_path / "a",
            store=postgres_url,
            settle_ms=0,
            args=name,
            grpc_listen=grpc_listen,
            http_listen=http_listen,
        ) as second:
            writer.apply_deltas(tree("after"))
            writer.flush()  # the writer re-attaches to the new process under the same name
            assert client.are_completed("crash/name", ["before", "after"]) == [True, True]
            assert writer.close().counts.anomalies == 0
            assert "goes by the replica name" not in second.log()
    finally:
        client.close()


def test_a_replica_answers_reads_itself_while_the_owner_is_paused(tmp_path: Path, postgres_url: str) -> None:
    """Status, writers, events, progress and completed ids come from the replica (the owner's
    published status, the registry, the committed completions) over gRPC and HTTP, shaped as the
    owner's answers: they answer while the owner is stopped (SIGSTOP), when a write through the same
    replica cannot, and the replica forwarded none of them."""
    name = "reads/run"
    with replicas(tmp_path, postgres_url, 2, settle_ms=0) as (owner, replica):
        with (
            tally.Client(owner.grpc_address) as client,
            grpc.insecure_channel(owner.grpc_address) as owner_channel,
            grpc.insecure_channel(replica.grpc_address) as replica_channel,
            httpx.Client(base_url=f"http://{owner.http_address}") as at_owner_http,
            httpx.Client(base_url=f"http://{replica.http_address}") as http,
        ):
            at_owner, stub = pb_grpc.CoordinatorStub(owner_channel), pb_grpc.CoordinatorStub(replica_channel)
            with client.writer(name, writer_id="w0") as w0:
                w0.apply_deltas(tree("z"))
            live = client.writer(name, writer_id="w1")  # stays open: a live writer with a pending source
            live.__enter__()
            for source in ("a", "b", "c"):
                live.apply_deltas(tree(source))
            live.apply_deltas(tree("half")[:2])
            live.save_cursor("half", b"row 7")
            live.flush()

            def answered_here(call: str) -> float:
                local = samples_of(http.get("/metrics").text, "tally_replica_local_calls_total")
                return local.get(f'{{call="{call}"}}', 0.0)

            def published() -> bool:
                """The replica answered from the owner's published status (not forwarded): current."""
                before = answered_here("GetCheckpoint")
                status = stub.GetCheckpoint(pb.GetCheckpointRequest(name=name))
                fresh = status.completed_count == 4 and status.pending_sources == 1
                return fresh and answered_here("GetCheckpoint") > before

            wait_until(published, timeout=30, what="the owner to publish the checkpoint's status")
            # The owner's answers, to compare with the replica's once the owner is stopped.
            writers = pb.ListWritersRequest(checkpoint=name, include_closed=True)
            owner_writers = at_owner.ListWriters(writers)
            owner_events = at_owner.ListEvents(pb.ListEventsRequest(checkpoint=name))
            owner_status = at_owner.GetCheckpoint(pb.GetCheckpointRequest(name=name))
            owner_cursor = at_owner.GetCursor(pb.GetCursorRequest(checkpoint=name, source_id="half"))
            http_reads = [
                f"/v1/checkpoints/{name.replace('/', '%2F')}",
                "/v1/checkpoints",
                f"/v1/writers?checkpoint={name}&include_closed=true",
                f"/v1/events?checkpoint={name}",
                f"/v1/progress?checkpoint={name}",
                f"/v1/completed?checkpoint={name}&limit=2",
                "/v1/replicas",
                f"/v1/cursors?checkpoint={name}&source_id=half",
                f"/v1/cursors?checkpoint={name}&source_id=a",
            ]
            owner_http = {path: at_owner_http.get(path) for path in http_reads}
            owner_bad = at_owner_http.get(f"/v1/events?checkpoint={name}&limit=5000")
            assert owner_bad.status_code == 400
            with pytest.raises(grpc.RpcError) as owner_refusal:
                at_owner.ListEvents(pb.ListEventsRequest(checkpoint=name, limit=5000))
            forwarded_before = samples_of(http.get("/metrics").text, "tally_replica_forwarded_calls_total")
            owner.process.send_signal(signal.SIGSTOP)
            try:
                status = stub.GetCheckpoint(pb.GetCheckpointRequest(name=name))
                assert (status.completed_count, status.pending_sources, status.live_writers) == (4, 1, 1)
                assert [w.writer_id for w in status.writers] == ["w1"]
                assert status.owner == owner_status.owner != ""
                listed = stub.ListCheckpoints(pb.ListCheckpointsRequest())
                assert [c.name for c in listed.checkpoints] == [name]
                assert [w.writer_id for w in listed.checkpoints[0].writers] == ["w1"]
                bare = stub.ListCheckpoints(pb.ListCheckpointsRequest(without_writers=True)).checkpoints
                assert [(c.name, c.live_writers, len(c.writers)) for c in bare] == [(name, 1, 0)]
                bare_json = http.get("/v1/checkpoints", params={"writers": "false"}).json()["checkpoints"]
                assert [(c["name"], c["live_writers"], c["writers"]) for c in bare_json] == [(name, 1, [])]
                page = stub.ListWriters(writers)
                assert [(w.writer_id, w.state) for w in page.writers] == [
                    (w.writer_id, w.state) for w in owner_writers.writers
                ]
                assert [w.writer_id for w in page.writers] == ["w1", "w0"]
                assert stub.ListEvents(pb.ListEventsRequest(checkpoint=name)) == owner_events
                progress = stub.GetProgress(pb.GetProgressRequest(checkpoint=name))
                assert progress.samples[-1].completed_count == 4
                first = stub.ListCompleted(pb.ListCompletedRequest(checkpoint=name, limit=3))
                assert (list(first.source_ids), first.next_after) == (["a", "b", "c"], "c")
                rest = stub.ListCompleted(pb.ListCompletedRequest(checkpoint=name, after="c"))
                assert (list(rest.source_ids), rest.next_after) == (["z"], "")
                cursor = stub.GetCursor(pb.GetCursorRequest(checkpoint=name, source_id="half"))
                assert (cursor.found, cursor.data, cursor.writer_id) == (True, b"row 7", "w1")
                assert cursor == owner_cursor
                assert not stub.GetCursor(pb.GetCursorRequest(checkpoint=name, source_id="a")).found
                done = stub.AreCompleted(pb.AreCompletedRequest(checkpoint=name, source_ids=["a", "half"]))
                assert list(done.completed) == [True, False]
                # Refused at the replica as at the owner: the same code, message and details.
                with pytest.raises(grpc.RpcError) as refusal:
                    stub.ListEvents(pb.ListEventsRequest(checkpoint=name, limit=5000))
                assert refusal.value.code() == owner_refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refusal.value.details() == owner_refusal.value.details()
                with pytest.raises(grpc.RpcError) as unnamed:
                    stub.GetCheckpoint(pb.GetCheckpointRequest(name=""))
                assert error_info(unnamed.value).metadata["field"] == "name"
                # Over HTTP: the owner's JSON, from the replica.
                for path, answer in owner_http.items():
                    got = http.get(path)
                    assert got.status_code == answer.status_code == 200, (path, got.text)
                    if path.startswith(("/v1/events", "/v1/completed", "/v1/writers", "/v1/cursors")):
                        mine, theirs = got.json(), answer.json()
                        if path.startswith("/v1/writers"):  # live counters move; who and which state do not
                            mine = [(w["writer_id"], w["state"]) for w in mine["writers"]]
                            theirs = [(w["writer_id"], w["state"]) for w in theirs["writers"]]
                        assert mine == theirs, path
                    elif path == "/v1/replicas":
                        assert got.json()["answered_by"] != answer.json()["answered_by"]
                    else:
                        assert set(got.json()) == set(answer.json()), path
                assert http.get(http_reads[0]).json()["completed_count"] == 4
                are = http.post("/v1/are-completed", json={"checkpoint": name, "source_ids": ["z", "x"]})
                assert are.json() == {"completed": [True, False]}
                bad = http.get(f"/v1/events?checkpoint={name}&limit=5000")
                assert (bad.status_code, bad.json()) == (owner_bad.status_code, owner_bad.json())
                # Watching: the published status now (gRPC stream, HTTP Server-Sent Events).
                watch = stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint=name, interval_ms=50))
                seen = next(watch)
                watch.cancel()
                assert (seen.completed_count, seen.pending_sources, seen.live_writers) == (4, 1, 1)
                with http.stream("GET", "/v1/watch", params={"checkpoint": name}) as events:
                    line = next(x for x in events.iter_lines() if x.startswith("data: "))
                assert json.loads(line[len("data: ") :])["completed_count"] == 4
                # A write through the same replica goes to the stopped owner: it cannot be answered.
                with pytest.raises(grpc.RpcError) as write:
                    stub.OpenWriter(pb.OpenWriterRequest(checkpoint=name, writer_id="w2"), timeout=2)
                assert write.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                metrics = http.get("/metrics").text
            finally:
                owner.process.send_signal(signal.SIGCONT)
            # The replica stayed a replica throughout: the reads above were its own.
            assert "taking over store" not in replica.log()
            forwarded = samples_of(metrics, "tally_replica_forwarded_calls_total")
            assert sum(forwarded.values()) - sum(forwarded_before.values()) <= 1  # the OpenWriter
            local = samples_of(metrics, "tally_replica_local_calls_total")
            for call in ("GetCheckpoint", "ListCheckpoints", "ListWriters", "ListEvents", "GetProgress"):
                assert local[f'{{call="{call}"}}'] >= 2, call  # one over gRPC, one over HTTP
            assert local['{call="ListCompleted"}'] >= 3 and local['{call="AreCompleted"}'] >= 2
            assert local['{call="GetCursor"}'] >= 4
            assert local['{call="WatchCheckpoint"}'] >= 2
            # A checkpoint the owner has not published (here: none) is asked of the owner.
            with pytest.raises(grpc.RpcError) as missing:
                stub.GetCheckpoint(pb.GetCheckpointRequest(name="no/such"))
            with pytest.raises(grpc.RpcError) as missing_at_owner:
                at_owner.GetCheckpoint(pb.GetCheckpointRequest(name="no/such"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert missing.value.details() == missing_at_owner.value.details()
            assert http.get("/v1/events?checkpoint=no/such").status_code == 404
            live.__exit__(None, None, None)


def test_every_call_through_a_replica_has_a_request_id_and_an_access_line_the_owner_shares(
    tmp_path: Path, postgres_url: str
) -> None:
    """A replica logs each call as the owner does (request id, access line, latency histogram), for
    the reads it answers and the calls it forwards; a forwarded call reaches the owner with the same
    request id (made up by the replica when the caller sent none), so the two lines tie together."""
    with replicas(tmp_path, postgres_url, 2, settle_ms=0, args=["--log-format", "json"]) as (owner, replica):
        with grpc.insecure_channel(replica.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            _, local = stub.AreCompleted.with_call(
                pb.AreCompletedRequest(checkpoint="ids/run", source_ids=["a"]),
                metadata=[("x-request-id", "local-1")],
            )
            _, forwarded = stub.OpenWriter.with_call(
                pb.OpenWriterRequest(checkpoint="ids/run", writer_id="w1"),
                metadata=[("x-request-id", "fwd-1")],
            )
            _, anonymous = stub.TokenIsCurrent.with_call(
                pb.TokenIsCurrentRequest(checkpoint="ids/run", source_id="a", token=1)
            )
        assert dict(local.trailing_metadata())["x-request-id"] == "local-1"
        assert [v for k, v in forwarded.trailing_metadata() if k == "x-request-id"] == ["fwd-1"]
        made_up = [v for k, v in anonymous.trailing_metadata() if k == "x-request-id"]
        assert len(made_up) == 1 and made_up[0] not in ("", "-")
        http_local = httpx.get(
            f"http://{replica.http_address}/v1/checkpoints", headers={"X-Request-ID": "local-2"}
        )
        http_forwarded = httpx.get(
            f"http://{replica.http_address}/v1/claims/current",
            params={"checkpoint": "ids/run", "source_id": "a", "token": 1},
            headers={"X-Request-ID": "fwd-2"},
        )
        assert http_local.status_code == http_forwarded.status_code == 200, http_forwarded.text
        assert http_local.headers.get_list("x-request-id") == ["local-2"]
        assert http_forwarded.headers.get_list("x-request-id") == ["fwd-2"]  # once, not twice

        def access(server: RunningServer, ids: set[str]) -> dict[str, dict[str, object]]:
            found: dict[str, dict[str, object]] = {}

            def logged() -> bool:
                for line in server.log().splitlines():
                    entry = json.loads(line) if line.startswith("{") else {}
                    if entry.get("logger") == "tally_server.access" and entry["request_id"] in ids:
                        found[entry["request_id"]] = entry
                return set(found) == ids

            wait_until(logged, timeout=10, what=f"access lines {sorted(ids)}")
            return found

        at_replica = access(replica, {"local-1", "fwd-1", made_up[0], "local-2", "fwd-2"})
        assert at_replica["local-1"]["method"] == "/tally.v1.Coordinator/AreCompleted"
        assert at_replica["fwd-2"]["path"] == "/v1/claims/current" and at_replica["fwd-2"]["status"] == 200
        # The owner saw the forwarded calls only, under the replica's ids.
        at_owner = access(owner, {"fwd-1", made_up[0], "fwd-2"})
        assert at_owner["fwd-1"]["method"] == "/tally.v1.Coordinator/OpenWriter"
        owner_ids = {json.loads(x).get("request_id") for x in owner.log().splitlines() if x.startswith("{")}
        assert not {"local-1", "local-2"} & owner_ids
        # Timed on the replica under its own names (the owner's series count the forwarded calls).
        timed = samples_of(
            httpx.get(f"http://{replica.http_address}/metrics").text,
            "tally_replica_grpc_request_duration_seconds_count",
        )
        assert timed['{code="OK",method="/tally.v1.Coordinator/AreCompleted"}'] == 1.0
        assert timed['{code="OK",method="/tally.v1.Coordinator/OpenWriter"}'] == 1.0


def test_a_watch_through_a_replica_follows_the_owners_changes(tmp_path: Path, postgres_url: str) -> None:
    """WatchCheckpoint through a replica streams the owner's published status as it changes; a
    checkpoint with no published status is watched at the owner instead (the stream forwarded)."""
    name = "watch/run"
    with replicas(tmp_path, postgres_url, 2, settle_ms=0) as (owner, replica):
        with (
            tally.Client(owner.grpc_address) as client,
            grpc.insecure_channel(replica.grpc_address) as channel,
            client.writer(name, writer_id="w1") as writer,
        ):
            stub = pb_grpc.CoordinatorStub(channel)
            # A checkpoint with no published status is watched at the owner (here: one that does
            # not exist, so the owner's refusal comes back through the replica).
            with pytest.raises(grpc.RpcError) as unknown:
                next(stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint="no/such", interval_ms=50)))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "no/such" in unknown.value.details()
            refused = samples_of(
                httpx.get(f"http://{replica.http_address}/metrics").text,
                "tally_replica_forwarded_calls_total",
            )
            assert refused['{outcome="refused",transport="grpc"}'] == 1.0
            writer.apply_deltas(tree("a"))
            writer.flush()

            def published() -> bool:
                """Answered by the replica itself (not forwarded), with the first completion."""
                before = local_calls(replica).get('{call="GetCheckpoint"}', 0.0)
                status = stub.GetCheckpoint(pb.GetCheckpointRequest(name=name))
                return (
                    status.completed_count == 1
                    and local_calls(replica).get('{call="GetCheckpoint"}', 0.0) > before
                )

            wait_until(published, timeout=30, what="the owner to publish the first completion")
            watch = stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint=name, interval_ms=50))
            assert next(watch).completed_count == 1
            writer.apply_deltas(tree("b"))
            writer.flush()
            # The next snapshot sent is a change: the second completion, once published.
            assert next(watch).completed_count == 2
            watch.cancel()
        assert local_calls(replica).get('{call="WatchCheckpoint"}') == 1.0  # the unknown one went on


def local_calls(replica: RunningServer) -> dict[str, float]:
    """The reads a replica answered itself, by call (``tally_replica_local_calls_total``)."""
    return samples_of(
        httpx.get(f"http://{replica.http_address}/metrics").text, "tally_replica_local_calls_total"
    )


def test_a_replica_lists_failures_and_remaining_sources_as_the_owner_does(
    tmp_path: Path, postgres_url: str
) -> None:
    """ListFailures and ListRemaining answered by the replica itself (from the registry and the
    committed completions): page for page the owner's answers, ids in code point order whatever the
    database's collation, a completed source dropped from both, and answered while the owner is
    stopped (SIGSTOP)."""
    name = "lists/run"
    ids = ["z", "Z", "é-1", "e-2", "ä", "a", "b", "c", "日本"]
    with replicas(tmp_path, postgres_url, 2, settle_ms=0) as (owner, replica):
        with (
            tally.Client(owner.grpc_address) as at_owner,
            tally.Client(replica.grpc_address) as here,
            tally.Client(f"http://{replica.http_address}") as here_http,
        ):
            with at_owner.writer(name, writer_id="w1") as w:
                w.declare(ids)
                for i, sid in enumerate(ids):
                    for _ in range(1 + i % 3):  # 1, 2 or 3 failed attempts
                        w.report_failure(sid, f"boom {sid}")
                w.apply_deltas(tree("b"))  # completed: no longer failed, nor remaining
            at_owner.set_max_attempts(name, 2)

            def failures(client: tally.Client, **options: object) -> list[tuple[str, int, bool]]:
                return [(f.source_id, f.attempts, f.failed) for f in client.failures(name, **options)]  # type: ignore[arg-type]

            def answers(client: tally.Client) -> dict[str, object]:
                return {
                    "all": failures(client, page_size=2),
                    "failed": failures(client, failed_only=True, page_size=1),
                    "asked": failures(client, source_ids=["ä", "b", "nope", "Z"]),
                    "remaining": list(client.remaining(name, page_size=2)),
                }

            expected = answers(at_owner)
            assert [s for s, _, _ in expected["all"]] == sorted(set(ids) - {"b"})  # type: ignore[union-attr]
            assert expected["remaining"] == sorted(set(ids) - {"b"})
            wait_until(lambda: published_here(here, replica, name), timeout=30, what="a published status")
            owner.process.send_signal(signal.SIGSTOP)
            try:
                assert answers(here) == expected
                assert answers(here_http) == expected
            finally:
                owner.process.send_signal(signal.SIGCONT)
        local = local_calls(replica)
        assert local['{call="ListFailures"}'] >= 6 and local['{call="ListRemaining"}'] >= 2


def published_here(client: tally.Client, replica: RunningServer, name: str) -> bool:
    """Whether the replica answers ``name``'s status itself (the owner published it)."""
    before = local_calls(replica).get('{call="GetCheckpoint"}', 0.0)
    client.checkpoint(name)
    return local_calls(replica).get('{call="GetCheckpoint"}', 0.0) > before


def test_a_replica_answers_any_ids_in_the_order_asked_as_the_owner_does(
    tmp_path: Path, postgres_url: str
) -> None:
    """Ids of any characters (non-ASCII, NUL, quotes, backslashes, array and SQL syntax, the longest
    accepted), asked with duplicates, with ids that differ by a byte, as an empty list or tens of
    thousands at once: the replica answers from the database exactly what the owner answers from
    memory, in the order asked."""
    odd = [
        "é",
        "e\u0301",  # the same letter decomposed: other bytes, another id
        "日本/ファイル.jsonl",
        "🙂",
        "nul\x00inside",
        "line\nbreak\ttab",
        "q\"uote's",
        "back\\slash\\",
        "{a,b}",
        "NULL",
        " ",
        "%b %s $1",
        "x" * 511,  # the longest id accepted (max_id_bytes)
        "é" * 255,
    ]
    rng = random.Random(11)
    done = [s for i, s in enumerate(odd) if i % 2 == 0] + [f"bulk-{i}" for i in range(2_000)]
    done_set = set(done)
    # Ids one byte away from completed ones, and the odd ids left incomplete.
    near = ["e", "x" * 510, "bulk-", "bulk-2000", "BULK-1", "nul", *[s for s in odd if s not in done_set]]
    many = done + near + [f"never-{i}" for i in range(28_000)]
    rng.shuffle(many)
    asks = [
        [],
        odd,
        odd + odd[::-1] + [odd[0]] * 5,  # duplicates, each answered where it was asked
        near,
        many,
    ]
    with replicas(tmp_path, postgres_url, 2) as (owner, replica):
        with tally.Client(owner.grpc_address) as client, client.writer("rep/odd", writer_id="w") as w:
            w.apply_deltas([d for i, s in enumerate(done) for d in ((f"t{i}", s, 1), (f"t{i}_0", s, -1))])
            w.flush()
        with tally.Client(owner.grpc_address) as at_owner, tally.Client(replica.grpc_address) as at_replica:
            for ids in asks:
                expected = [s in done_set for s in ids]
                assert at_owner.are_completed("rep/odd", ids) == expected
                assert at_replica.are_completed("rep/odd", ids) == expected
            assert at_replica.are_completed("rep/none-yet", odd) == [False] * len(odd)
        metrics = httpx.get(f"http://{replica.http_address}/metrics").text
        answered = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("tally_replica_are_completed_calls_total")
        )
        assert answered >= len(asks) + 1  # answered there, not forwarded (the SDK may split a long list)
