"""Declared totals (issue #12), the wire contract: a checkpoint's declared sources give its status a
``total`` and an exact ``remaining`` (declared sources not completed) as sources complete, are
un-completed by an anomaly, or the checkpoint is reset; declarations are idempotent and additive,
survive a kill -9 of the coordinator, and page. Real ``tally serve`` processes, both stores.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.integration.raw import stub
from tests.integration.workload import tree


def apply(
    coordinator: pb_grpc.CoordinatorStub, handle: str, batch: list[tuple[str, str, int]], seq: int
) -> None:
    deltas = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in batch]
    coordinator.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas, batch_seq=seq))


def counts(coordinator: pb_grpc.CoordinatorStub, checkpoint: str) -> tuple[int, int, int]:
    status = coordinator.GetCheckpoint(pb.GetCheckpointRequest(name=checkpoint))
    return status.completed_count, status.total, status.remaining


def remaining(coordinator: pb_grpc.CoordinatorStub, checkpoint: str, limit: int = 0) -> list[str]:
    out, after = [], ""
    while True:
        page = coordinator.ListRemaining(
            pb.ListRemainingRequest(checkpoint=checkpoint, after=after, limit=limit)
        )
        out += list(page.source_ids)
        if not page.next_after:
            return out
        after = page.next_after


def test_remaining_is_exact_as_sources_complete_and_survives_a_kill(
    tmp_path: Path, store: str | None
) -> None:
    data = tmp_path / "data"
    sources = [f"s{i:02d}" for i in range(10)]
    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="tot/run", writer_id="w")).handle
        apply(coordinator, handle, tree("s00"), 1)  # completed before it was declared
        apply(coordinator, handle, tree("extra"), 2)  # completed, never declared
        declared = coordinator.DeclareSources(
            pb.DeclareSourcesRequest(checkpoint="tot/run", source_ids=sources[:6])
        )
        assert (declared.total, declared.remaining) == (6, 5)
        # Idempotent and additive: some again, some new.
        again = coordinator.DeclareSources(
            pb.DeclareSourcesRequest(checkpoint="tot/run", source_ids=sources[4:])
        )
        assert (again.total, again.remaining) == (10, 9)
        for seq, source in enumerate(sources[1:4], start=3):
            apply(coordinator, handle, tree(source), seq)
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert counts(coordinator, "tot/run") == (5, 10, 6)  # "extra" counts as completed, not declared
        assert remaining(coordinator, "tot/run", limit=4) == sources[4:]
        # An anomaly un-completes a declared source: it is remaining again.
        apply(coordinator, handle, [("1_s01", "s01", 1)], 6)
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert counts(coordinator, "tot/run") == (4, 10, 7)
        assert "s01" in remaining(coordinator, "tot/run")
        server.kill()
    with running_server(data, settle_ms=0, store=store) as again_, stub(again_) as coordinator:
        # Before the set is read again the status says so (-1); reading it makes remaining exact.
        assert coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="tot/run")).total == 10
        assert len(remaining(coordinator, "tot/run")) == 7
        assert counts(coordinator, "tot/run") == (4, 10, 7)
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="tot/run", writer_id="w2")).handle
        for seq, source in enumerate(["s01", *sources[4:]], start=1):
            apply(coordinator, handle, tree(source), seq)
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert counts(coordinator, "tot/run")[1:] == (10, 0)
        assert remaining(coordinator, "tot/run") == []
        coordinator.CloseWriter(pb.CloseWriterRequest(handle=handle))
        coordinator.ResetCheckpoint(pb.ResetCheckpointRequest(name="tot/run", force=True))
        assert counts(coordinator, "tot/run") == (0, 10, 10)  # declared sources stay; none is completed


def test_a_count_alone_gives_a_total_and_refusals_say_why(server: RunningServer) -> None:
    with stub(server) as coordinator:
        counted = coordinator.DeclareSources(pb.DeclareSourcesRequest(checkpoint="tot/count", count=64))
        assert (counted.total, counted.remaining) == (64, 64)
        lower = coordinator.DeclareSources(pb.DeclareSourcesRequest(checkpoint="tot/count", count=10))
        assert lower.total == 64  # a count only ever raises the total
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="tot/count", writer_id="w")).handle
        apply(coordinator, handle, tree("a"), 1)
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert counts(coordinator, "tot/count") == (1, 64, 63)
        with pytest.raises(grpc.RpcError) as negative:
            coordinator.DeclareSources(pb.DeclareSourcesRequest(checkpoint="tot/count", count=-1))
        assert (
            negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "out of range" in negative.value.details()
        )
        with pytest.raises(grpc.RpcError) as empty:
            coordinator.DeclareSources(
                pb.DeclareSourcesRequest(checkpoint="tot/count", source_ids=["ok", ""])
            )
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert counts(coordinator, "tot/count")[1] == 64  # the refused call declared nothing
        with pytest.raises(grpc.RpcError) as unknown:
            coordinator.ListRemaining(pb.ListRemainingRequest(checkpoint="tot/none"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # No declaration: no total, remaining not known.
        coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="tot/plain", writer_id="w"))
        assert counts(coordinator, "tot/plain")[1:] == (0, -1)


def test_declare_and_remaining_over_http(server: RunningServer) -> None:
    with httpx.Client(base_url=server.http_url) as http:
        ids = [f"h{i}" for i in range(5)]
        declared = http.post("/v1/declare", json={"checkpoint": "tot/http", "source_ids": ids})
        assert declared.status_code == 200 and declared.json() == {"total": 5, "remaining": 5}
        page = http.get("/v1/remaining", params={"checkpoint": "tot/http", "limit": 2}).json()
        assert page == {"source_ids": ["h0", "h1"], "next_after": "h1"}
        status = http.get("/v1/checkpoints/tot%2Fhttp").json()
        assert (status["total"], status["remaining"]) == (5, 5)
