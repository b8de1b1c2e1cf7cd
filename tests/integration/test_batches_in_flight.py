"""Several batches of one writer on the wire at once (issue #10), over gRPC and HTTP: each sent as
``ordered``, the coordinator applies them in their numbers' order whatever order they arrive in, and
a batch sent again after a later one was applied is answered again, never applied twice."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer


def open_writer(stub: pb_grpc.CoordinatorStub, checkpoint: str) -> pb.OpenWriterResponse:
    reply: pb.OpenWriterResponse = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=checkpoint, writer_id="w"))
    return reply


def batch(
    handle: str, seq: int, deltas: list[tuple[str, str, int]], ordered: bool = True
) -> pb.ApplyDeltasRequest:
    return pb.ApplyDeltasRequest(
        handle=handle,
        batch_seq=seq,
        ordered=ordered,
        columns=pb.DeltaColumns(
            task_ids=[t for t, _, _ in deltas],
            source_ids=[s for _, s, _ in deltas],
            deltas=[d for *_, d in deltas],
        ),
    )


def test_the_coordinator_says_how_many_batches_may_be_in_flight(stub: pb_grpc.CoordinatorStub) -> None:
    assert open_writer(stub, "fly/open").max_batches_in_flight == 2


def test_a_batch_that_overtook_the_one_before_it_waits_for_it(stub: pb_grpc.CoordinatorStub) -> None:
    handle = open_writer(stub, "fly/overtaken").handle
    # Batch 2 takes "a" from 1 to 0 (it completes); applied before batch 1, it would take it to -1.
    first = batch(handle, 1, [("0_a", "a", 1)])
    second = batch(handle, 2, [("0_a_0", "a", -1)])
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(stub.ApplyDeltas, second)
        time.sleep(0.2)  # batch 2 is waiting on the coordinator (not a synchronisation: it must wait)
        assert not early.done()
        assert stub.ApplyDeltas(first).counts.applied == 1
        assert early.result(timeout=30).counts == pb.ApplyCounts(applied=1, completed=1)
    done = stub.AreCompleted(pb.AreCompletedRequest(checkpoint="fly/overtaken", source_ids=["a"]))
    assert list(done.completed) == [True]


def test_a_batch_whose_previous_one_never_comes_is_refused_unapplied(stub: pb_grpc.CoordinatorStub) -> None:
    handle = open_writer(stub, "fly/lost").handle
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyDeltas(batch(handle, 2, [("0_a", "a", 1)]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "batch 2" in (info.value.details() or "") and "nothing was applied" in (info.value.details() or "")
    # Sent again after batch 1, it applies.
    assert stub.ApplyDeltas(batch(handle, 1, [("0_b", "b", 1)])).counts.applied == 1
    assert stub.ApplyDeltas(batch(handle, 2, [("0_a", "a", 1)])).counts.applied == 1
    status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="fly/lost"))
    assert status.pending_sources == 2


def test_an_ordered_batch_sent_again_after_a_later_one_gets_its_answer_again(
    stub: pb_grpc.CoordinatorStub,
) -> None:
    handle = open_writer(stub, "fly/again").handle
    first = batch(handle, 1, [("0_a", "a", 1), ("0_a_0", "a", -1)])
    assert stub.ApplyDeltas(first).counts == pb.ApplyCounts(applied=2, completed=1)
    assert stub.ApplyDeltas(batch(handle, 2, [("0_b", "b", 1)])).counts.applied == 1
    # The first one's answer was lost: sent again, it is answered as before and not applied twice.
    assert stub.ApplyDeltas(first).counts == pb.ApplyCounts(applied=2, completed=1)
    # Not ordered (a client sending one batch at a time), a number below the last is refused.
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyDeltas(batch(handle, 1, [("0_a", "a", 1), ("0_a_0", "a", -1)], ordered=False))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="fly/again"))
    assert (status.completed_count, status.pending_sources) == (1, 1)


def http_batch(seq: int, deltas: list[tuple[str, str, int]], ordered: bool = True) -> dict[str, object]:
    columns = {"task_ids": [t for t, _, _ in deltas], "source_ids": [s for _, s, _ in deltas]}
    return {"columns": {**columns, "deltas": [d for *_, d in deltas]}, "batch_seq": seq, "ordered": ordered}


def test_over_http_the_coordinator_says_how_many_batches_may_be_in_flight(server: RunningServer) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        opened = http.post("/v1/writers", json={"checkpoint": "hfly/open", "writer_id": "w"}).json()
    assert opened["max_batches_in_flight"] == 2


def test_over_http_batches_apply_in_their_order_and_a_resent_one_is_answered_again(
    server: RunningServer,
) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
        handle = http.post("/v1/writers", json={"checkpoint": "hfly/order", "writer_id": "w"}).json()[
            "handle"
        ]
        url = f"/v1/writers/{handle}/deltas"
        first = http_batch(1, [("0_a", "a", 1)])
        # Batch 2 takes "a" from 1 to 0 (it completes); applied before batch 1, it would take it to -1.
        early = pool.submit(
            httpx.post, server.http_url + url, json=http_batch(2, [("0_a_0", "a", -1)]), timeout=30
        )
        time.sleep(0.2)  # batch 2 is waiting on the coordinator (not a synchronisation: it must wait)
        assert not early.done()
        assert http.post(url, json=first).json()["counts"]["applied"] == 1
        second = early.result(timeout=30)
        assert second.status_code == 200 and second.json()["counts"]["completed"] == 1
        # The first one's answer was lost: sent again, it is answered as before, not applied twice.
        again = http.post(url, json=first)
        assert again.status_code == 200 and again.json()["counts"]["applied"] == 1
        # Not ordered, a number below the last is refused.
        assert http.post(url, json=http_batch(1, [("0_a", "a", 1)], ordered=False)).status_code == 409
        status = http.get("/v1/checkpoints/hfly%2Forder").json()
    assert (status["completed_count"], status["pending_sources"], status["anomalies"]) == (1, 0, 0)


def test_over_http_a_batch_whose_previous_one_never_comes_is_refused_unapplied(server: RunningServer) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        handle = http.post("/v1/writers", json={"checkpoint": "hfly/lost", "writer_id": "w"}).json()["handle"]
        reply = http.post(f"/v1/writers/{handle}/deltas", json=http_batch(2, [("0_a", "a", 1)]))
        assert reply.status_code == 503 and "nothing was applied" in reply.text
        status = http.get("/v1/checkpoints/hfly%2Flost").json()
    assert status["pending_sources"] == 0


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_sdk_counts_the_same_with_one_or_two_batches_in_flight(
    server: RunningServer, in_flight: int, transport: str
) -> None:
    checkpoint = f"fly/sdk-{in_flight}-{transport}"
    sources = [f"s{i:04d}" for i in range(2000)]
    with tally.Client(server.grpc_address if transport == "grpc" else server.http_url) as client:
        # Batches go by size and by flush() only: a timer flush (a loaded machine pausing the
        # loop below for more than flush_interval_s) would send a 13th, smaller batch.
        client._config = dataclasses.replace(
            client._config, max_batch=500, max_batches_in_flight=in_flight, flush_interval_s=600.0
        )
        with client.writer(checkpoint, writer_id="w") as w:
            for sid in sources:
                w.apply_deltas([(f"0_{sid}", sid, 1), (f"0_{sid}_0", sid, 1)])
            for sid in sources[::2]:
                w.apply_deltas([(f"0_{sid}_0_0", sid, -1), (f"0_{sid}_0_1", sid, -1)])
            w.flush()
            health = w.health()
            senders = [t for t in threading.enumerate() if t.name.startswith("tally-sender")]
        assert len(senders) == in_flight  # one sender thread per batch on the wire
        assert health.batches_sent == 12 and health.buffered == 0 and health.retries == 0
        assert client.are_completed(checkpoint, sources) == [i % 2 == 0 for i in range(len(sources))]
