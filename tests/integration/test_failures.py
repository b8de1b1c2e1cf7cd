"""Failure budgets (issue #12), the wire contract: failed attempts reported through a writer are
durable when the call returns, a source that used up its checkpoint's budget is failed (status
counts it, listings say so, with reasons) until it is retried or completes, across a kill -9 of the
coordinator, on both stores. Real ``tally serve`` processes over raw gRPC and HTTP.
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


def failures(
    coordinator: pb_grpc.CoordinatorStub, checkpoint: str, **options: object
) -> dict[str, tuple[int, bool]]:
    page = coordinator.ListFailures(pb.ListFailuresRequest(checkpoint=checkpoint, **options))  # type: ignore[arg-type]
    return {s.source_id: (s.attempts, s.failed) for s in page.sources}


def test_a_source_failed_up_to_the_budget_stays_failed_across_a_kill_until_retried(
    tmp_path: Path, store: str | None
) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        budget = coordinator.SetFailureBudget(
            pb.SetFailureBudgetRequest(checkpoint="fail/run", max_attempts=2)
        )
        assert (budget.max_attempts, budget.failed_sources) == (2, 0)
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/run", writer_id="w1")).handle
        first = coordinator.ReportFailure(
            pb.ReportFailureRequest(handle=handle, source_id="poison", reason="OOM")
        )
        assert (first.attempts, first.failed, first.max_attempts) == (1, False, 2)
        coordinator.ReportFailure(pb.ReportFailureRequest(handle=handle, source_id="flaky", reason="timeout"))
        second = coordinator.ReportFailure(
            pb.ReportFailureRequest(handle=handle, source_id="poison", reason="OOM again")
        )
        assert (second.attempts, second.failed) == (2, True)
        status = coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/run"))
        assert (status.failed_sources, status.max_attempts) == (1, 2)
        events = coordinator.ListEvents(pb.ListEventsRequest(checkpoint="fail/run")).events
        (failed,) = [e for e in events if e.kind == "source_failed"]
        assert (
            "source poison failed 2 times" in failed.message
            and "tally retry fail/run poison" in failed.message
        )
        server.kill()  # durable when ReportFailure returned
    with running_server(data, settle_ms=0, store=store) as again, stub(again) as coordinator:
        status = coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/run"))
        assert (status.failed_sources, status.max_attempts) == (1, 2)
        assert failures(coordinator, "fail/run") == {"flaky": (1, False), "poison": (2, True)}
        assert failures(coordinator, "fail/run", failed_only=True) == {"poison": (2, True)}
        (poison,) = coordinator.ListFailures(
            pb.ListFailuresRequest(checkpoint="fail/run", source_ids=["poison", "never"])
        ).sources
        assert [(a.reason, a.writer_id) for a in poison.recent] == [("OOM", "w1"), ("OOM again", "w1")]
        # Retried: it runs again (and may fail again, counted from zero).
        assert (
            coordinator.RetryFailed(
                pb.RetryFailedRequest(checkpoint="fail/run", source_ids=["poison"])
            ).cleared
            == 1
        )
        assert failures(coordinator, "fail/run") == {"flaky": (1, False)}
        assert coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/run")).failed_sources == 0
        # A source that completes loses its failed attempts; a failure of a completed source is refused.
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/run", writer_id="w2")).handle
        deltas = [pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in tree("flaky")]
        coordinator.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=deltas, batch_seq=1))
        coordinator.Flush(pb.FlushRequest(handle=handle))
        assert failures(coordinator, "fail/run") == {}
        with pytest.raises(grpc.RpcError) as done:
            coordinator.ReportFailure(
                pb.ReportFailureRequest(handle=handle, source_id="flaky", reason="late")
            )
        assert done.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is completed" in done.value.details()
    with running_server(data, settle_ms=0, store=store) as third, stub(third) as coordinator:
        assert failures(coordinator, "fail/run") == {}  # the clearing was durable too


def test_a_repeated_attempt_is_answered_as_the_first_and_counted_once_also_after_a_kill(
    tmp_path: Path, store: str | None
) -> None:
    """A retry after a lost answer (same attempt_id) must not use up the budget a second time."""
    data = tmp_path / "data"

    def report(coordinator: pb_grpc.CoordinatorStub, handle: str, attempt_id: str) -> tuple[int, bool]:
        request = pb.ReportFailureRequest(
            handle=handle, source_id="poison", reason="OOM", attempt_id=attempt_id
        )
        answer = coordinator.ReportFailure(request)
        return answer.attempts, answer.failed

    with running_server(data, settle_ms=0, store=store) as server, stub(server) as coordinator:
        coordinator.SetFailureBudget(pb.SetFailureBudgetRequest(checkpoint="fail/once", max_attempts=2))
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/once", writer_id="w1")).handle
        assert report(coordinator, handle, "a1") == (1, False)
        assert report(coordinator, handle, "a1") == (1, False)  # the retry of a1
        assert report(coordinator, handle, "a2") == (2, True)
        assert report(coordinator, handle, "a2") == (2, True)
        events = coordinator.ListEvents(pb.ListEventsRequest(checkpoint="fail/once")).events
        assert [e.kind for e in events].count("source_failed") == 1
        # A bad attempt id is refused, naming it, and counts nothing.
        with pytest.raises(grpc.RpcError) as bad:
            report(coordinator, handle, "é" * 3)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "attempt_id" in bad.value.details()
        assert failures(coordinator, "fail/once") == {"poison": (2, True)}
        server.kill()
    with (
        running_server(data, settle_ms=0, store=store) as again,
        stub(again) as coordinator,
        httpx.Client(base_url=again.http_url) as http,
    ):
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/once", writer_id="w2")).handle
        # The kill lost no attempt id: the answer to a2, lost before the kill, is retried here.
        assert report(coordinator, handle, "a2") == (2, True)
        body = {"source_id": "poison", "reason": "OOM", "attempt_id": "a1"}
        repeat = http.post(f"/v1/writers/{handle}/failures", json=body)
        assert repeat.status_code == 200 and repeat.json()["attempts"] == 2
        # Without an id, every report counts (older clients).
        assert report(coordinator, handle, "") == (3, True)
        assert report(coordinator, handle, "") == (4, True)
        (poison,) = coordinator.ListFailures(
            pb.ListFailuresRequest(checkpoint="fail/once", source_ids=["poison"])
        ).sources
        assert [a.writer_id for a in poison.recent] == ["w1", "w1", "w2", "w2"]


def test_failure_refusals_and_paging(server: RunningServer) -> None:
    with stub(server) as coordinator:
        with pytest.raises(grpc.RpcError) as unknown:
            coordinator.ListFailures(pb.ListFailuresRequest(checkpoint="fail/none"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as negative:
            coordinator.SetFailureBudget(pb.SetFailureBudgetRequest(checkpoint="fail/page", max_attempts=-1))
        assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "give 1 to" in negative.value.details()
        with pytest.raises(grpc.RpcError) as no_writer:
            coordinator.ReportFailure(pb.ReportFailureRequest(handle="nope", source_id="a"))
        assert no_writer.value.code() == grpc.StatusCode.NOT_FOUND
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/page", writer_id="w")).handle
        for i in range(5):
            coordinator.ReportFailure(
                pb.ReportFailureRequest(handle=handle, source_id=f"s{i}", reason="x" * 5000)
            )
        first = coordinator.ListFailures(pb.ListFailuresRequest(checkpoint="fail/page", limit=2))
        assert [s.source_id for s in first.sources] == ["s0", "s1"] and first.next_after == "s1"
        assert len(first.sources[0].recent[0].reason) == 1000  # reasons are kept to 1,000 characters
        rest = coordinator.ListFailures(pb.ListFailuresRequest(checkpoint="fail/page", after="s1", limit=10))
        assert [s.source_id for s in rest.sources] == ["s2", "s3", "s4"] and rest.next_after == ""
        # Unlimited budget (the default): counted, never failed.
        assert coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/page")).failed_sources == 0
        assert coordinator.RetryFailed(pb.RetryFailedRequest(checkpoint="fail/page")).cleared == 5


def test_failures_over_http_with_scoped_tokens(tmp_path: Path) -> None:
    tokens = {"TALLY_TOKENS": "w:worker@fail/,r:reader@fail/,x:worker@other/"}
    with (
        running_server(tmp_path / "data", settle_ms=0, env=tokens) as server,
        httpx.Client(base_url=server.http_url) as http,
    ):
        worker, reader, stranger = ({"authorization": f"Bearer {t}"} for t in ("w", "r", "x"))
        budget = http.post(
            "/v1/failures/budget", json={"checkpoint": "fail/http", "max_attempts": 1}, headers=worker
        )
        assert budget.status_code == 200 and budget.json() == {"max_attempts": 1, "failed_sources": 0}
        refused = http.post(
            "/v1/failures/budget", json={"checkpoint": "fail/http", "max_attempts": 3}, headers=stranger
        )
        assert refused.status_code == 403
        handle = http.post("/v1/writers", json={"checkpoint": "fail/http"}, headers=worker).json()["handle"]
        reported = http.post(
            f"/v1/writers/{handle}/failures", json={"source_id": "s", "reason": "bad row"}, headers=worker
        )
        assert reported.json() == {"attempts": 1, "failed": True, "max_attempts": 1}
        listed = http.get(
            "/v1/failures", params={"checkpoint": "fail/http", "source_id": ["s", "t"]}, headers=reader
        )
        (only,) = listed.json()["sources"]
        assert (
            only["source_id"] == "s" and only["failed"] is True and only["recent"][0]["reason"] == "bad row"
        )
        status = http.get("/v1/checkpoints/fail%2Fhttp", headers=reader).json()
        assert (status["failed_sources"], status["max_attempts"]) == (1, 1)
        assert (
            http.post("/v1/failures/retry", json={"checkpoint": "fail/http"}, headers=reader).status_code
            == 403
        )
        retried = http.post("/v1/failures/retry", json={"checkpoint": "fail/http"}, headers=worker)
        assert retried.json() == {"cleared": 1}


def test_a_reset_clears_failed_attempts_and_keeps_the_budget(server: RunningServer) -> None:
    with stub(server) as coordinator:
        coordinator.SetFailureBudget(pb.SetFailureBudgetRequest(checkpoint="fail/reset", max_attempts=1))
        handle = coordinator.OpenWriter(pb.OpenWriterRequest(checkpoint="fail/reset", writer_id="w")).handle
        coordinator.ReportFailure(pb.ReportFailureRequest(handle=handle, source_id="s", reason="x"))
        assert coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/reset")).failed_sources == 1
        coordinator.CloseWriter(pb.CloseWriterRequest(handle=handle))
        coordinator.ResetCheckpoint(pb.ResetCheckpointRequest(name="fail/reset"))
        status = coordinator.GetCheckpoint(pb.GetCheckpointRequest(name="fail/reset"))
        assert (status.failed_sources, status.max_attempts) == (0, 1)
        assert failures(coordinator, "fail/reset") == {}
