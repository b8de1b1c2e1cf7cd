"""An ApplyDeltas answer says whether the writer is settled; the SDK's flush then needs no call.

Settled means: as the answer left, everything the writer applied was durable (nothing settling,
no commit in flight). It must never be said while a completion is still settling, or a flush would
return before that completion is durable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.integration.raw import deltas
from tests.integration.test_metrics import scrape, value
from tests.integration.workload import tree

FLUSH = "/tally.v1.Coordinator/Flush"
COUNT = "tally_grpc_request_duration_seconds_count"


@pytest.fixture
def settling(tmp_path: Path) -> Iterator[RunningServer]:
    """A coordinator whose completions settle for a minute: only a flush or close ends that."""
    with running_server(tmp_path / "data", settle_ms=60_000) as srv:
        yield srv


@pytest.fixture
def short_settle(tmp_path: Path) -> Iterator[RunningServer]:
    """Completions settle for a second and a half: a flush waits that long for them."""
    with running_server(tmp_path / "data", settle_ms=1500) as srv:
        yield srv


def flushes(server: RunningServer) -> float:
    samples = [s for s in scrape(server) if s.name == COUNT and s.labels.get("method") == FLUSH]
    return sum(s.value for s in samples)


def test_answers_say_settled_only_when_nothing_is_settling(settling: RunningServer) -> None:
    with grpc.insecure_channel(settling.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="settled/a", writer_id="w")).handle
        pending = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas([("0_p", "p", 1)])))
        assert pending.settled  # nothing completed, the batch is in the journal: durable
        completing = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas(tree("a"))))
        assert completing.counts.applied == 6 and not completing.settled  # "a" settles for a minute
        still = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas([("0_q", "q", 1)])))
        assert not still.settled  # "a" is still settling
    # The same answer over HTTP.
    opened = httpx.post(f"{settling.http_url}/v1/writers", json={"checkpoint": "settled/b", "writer_id": "w"})
    url = f"{settling.http_url}/v1/writers/{opened.json()['handle']}/deltas"
    body = {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in tree("b")]}
    assert httpx.post(url, json=body).json()["settled"] is False
    assert httpx.post(url, json={"deltas": [{"task_id": "0_r", "source_id": "r", "delta": 1}]}).json() == {
        "counts": {"applied": 1, "skipped": 0, "rewritten": 0, "anomalies": 0, "completed": 0},
        "settled": False,  # "b" is still settling
        "refused": 0,  # nobody holds a claim on "r"
    }


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_a_flush_with_a_source_settling_asks_and_waits_for_it(
    short_settle: RunningServer, scheme: str
) -> None:
    address = short_settle.grpc_url if scheme == "grpc" else short_settle.http_url
    with tally.Client(address) as client, client.writer(f"settled/{scheme}", writer_id="w") as w:
        w.apply_deltas(tree("a"))
        w.flush()  # must not trust an answer that said "a" was settling
        assert client.are_completed(f"settled/{scheme}", ["a"]) == [True]
    if scheme == "grpc":
        assert flushes(short_settle) == 1


def test_at_settle_zero_a_flush_after_answered_batches_sends_nothing(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client, client.writer("settled/zero", writer_id="w") as w:
        for source in "abc":
            w.apply_deltas(tree(source))
            w.flush()
            # Durable when flush returned, though no Flush call went out.
            assert client.are_completed("settled/zero", [source]) == [True]
        w.apply_deltas([("0_d", "d", 1)])
        w.flush()
    assert flushes(server) == 0
    samples = scrape(server)
    assert value(samples, COUNT, method="/tally.v1.Coordinator/ApplyDeltas", code="OK") == 4
