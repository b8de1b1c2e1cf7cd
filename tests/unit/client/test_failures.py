"""Failure budgets in the SDK: report_failure, failures(), retry_failed, set_max_attempts, both wires."""

from __future__ import annotations

import asyncio
import urllib.parse

import pytest

import tally
from tally import Client
from tally import _calls as calls
from tally._transport import grpc_convert, http_convert
from tally._types import FailurePage
from tally.integrations.tracker import Tracker
from tally.v1 import coordinator_pb2 as pb
from tests.unit.client.tally_fakes import FakeTransport, make_async_client

# ------------------------------------------------------------------ Writer.report_failure


def test_report_failure_is_a_direct_call_that_flushes_nothing(client: Client, fake: FakeTransport) -> None:
    fake.max_attempts = 2
    with client.writer("cp") as w:
        w.apply_deltas([("t", "s9", 1)])
        w.save_cursor("a", b"1")
        first = w.report_failure("a", "boom")
        assert first == tally.FailureReport(attempts=1, failed=False, max_attempts=2)
        assert fake.count("flush") == 0 and fake.count("save_cursors") == 0
        second = w.report_failure("a", "boom again")
        assert (second.attempts, second.failed) == (2, True)
        assert fake.args["report_failure"] == [("h-1", "a", "boom"), ("h-1", "a", "boom again")]
        assert w.report_failure("b").attempts == 1  # reason defaults to ""
    assert fake.failed_attempts == {"a": ["boom", "boom again"], "b": [""]}


def test_report_failure_checks_its_arguments_and_needs_an_open_writer(
    client: Client, fake: FakeTransport
) -> None:
    w = client.writer("cp")
    with pytest.raises(tally.FailedPrecondition, match="not open"):
        w.report_failure("a", "x")
    with w:
        for bad in ("", None, 3):
            with pytest.raises(tally.InvalidArgument, match="source_id"):
                w.report_failure(bad, "x")  # type: ignore[arg-type]
        with pytest.raises(tally.InvalidArgument, match="reason"):
            w.report_failure("a", b"x")  # type: ignore[arg-type]
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        w.report_failure("a", "x")
    assert fake.count("report_failure") == 0


def test_a_completed_source_refuses_its_failure_and_the_writer_goes_on(
    client: Client, fake: FakeTransport
) -> None:
    fake.completed.add("done")
    with client.writer("cp") as w:
        with pytest.raises(tally.FailedPrecondition, match="completed"):
            w.report_failure("done", "x")
        w.apply_deltas([("t", "s", 1)])
        w.flush()
    assert "done" not in fake.failed_attempts


def test_report_failure_retries_an_unavailable_coordinator(client: Client, fake: FakeTransport) -> None:
    fake.fail("report_failure", tally.Unavailable("restarting"))
    with client.writer("cp") as w:
        assert w.report_failure("a", "x").attempts == 1
        w.report_failure("a", "y")
    assert fake.count("report_failure") == 3
    # The retry names the same attempt (the coordinator counts it once); the next report a new one.
    first, retry, second = fake.attempt_ids
    assert first == retry and len(first) == 32 and second not in ("", first)


def test_report_failure_of_a_writer_the_coordinator_forgot_is_lease_lost(
    client: Client, fake: FakeTransport
) -> None:
    fake.fail("report_failure", tally.NotFound("no such writer"))
    w = client.writer("cp")
    w.open()
    with pytest.raises(tally.LeaseLost):
        w.report_failure("a", "x")
    with pytest.raises(tally.LeaseLost):
        w.close()


def test_async_writer_reports_failures() -> None:
    fake = FakeTransport()
    fake.max_attempts = 1

    async def main() -> tally.FailureReport:
        async with make_async_client(fake) as client, client.writer("cp") as w:
            return await w.report_failure("a", "bad row")

    assert asyncio.run(main()) == tally.FailureReport(1, True, 1)
    assert fake.count("flush") == 0


def test_the_tracker_reports_failures(client: Client, fake: FakeTransport) -> None:
    fake.max_attempts = 3
    with client.writer("cp") as w:
        tracker = Tracker(w)
        assert tracker.report_failure("a", "oom").attempts == 1
        with pytest.raises(ValueError, match="non-empty"):
            tracker.report_failure("", "x")
    assert fake.failed_attempts == {"a": ["oom"]}


# ------------------------------------------------------------------ writer(max_attempts=)


def test_writer_max_attempts_sets_the_budget_before_opening(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp", max_attempts=3):
        pass
    assert fake.args["set_failure_budget"] == [("cp", 3)]
    assert fake.calls[:2] == ["set_failure_budget", "open_writer"]
    with client.writer("cp"):  # None: leave the budget alone
        pass
    assert fake.count("set_failure_budget") == 1


def test_a_refused_budget_opens_no_writer(client: Client, fake: FakeTransport) -> None:
    fake.fail("set_failure_budget", tally.PermissionDenied("reader token"))
    w = client.writer("cp", max_attempts=3)
    with pytest.raises(tally.PermissionDenied):
        w.open()
    assert fake.count("open_writer") == 0


@pytest.mark.parametrize("bad", [-1, 1_000_001, 2.5, True, "3"])
def test_a_bad_budget_is_refused_before_any_call(client: Client, fake: FakeTransport, bad: object) -> None:
    with pytest.raises(tally.InvalidArgument, match="max_attempts"):
        client.writer("cp", max_attempts=bad)  # type: ignore[arg-type]
    with pytest.raises(tally.InvalidArgument, match="max_attempts"):
        client.set_max_attempts("cp", bad)  # type: ignore[arg-type]
    assert fake.calls == []


def test_async_writer_max_attempts_sets_the_budget() -> None:
    fake = FakeTransport()

    async def main() -> None:
        async with make_async_client(fake) as client, client.writer("cp", max_attempts=0):
            pass

    asyncio.run(main())
    assert fake.calls[:2] == ["set_failure_budget", "open_writer"]
    assert fake.args["set_failure_budget"] == [("cp", 0)]


# ------------------------------------------------------------------ Client


def _fail(fake: FakeTransport, source_id: str, times: int) -> None:
    fake.failed_attempts[source_id] = [f"reason {i}" for i in range(times)]


def test_set_max_attempts_answers_how_many_sources_are_failed(client: Client, fake: FakeTransport) -> None:
    _fail(fake, "a", 2)
    _fail(fake, "b", 1)
    assert client.set_max_attempts("cp", 2) == 1
    assert client.set_max_attempts("cp", 1) == 2
    assert client.set_max_attempts("cp", 0) == 0


def test_failures_pages_through_every_source(client: Client, fake: FakeTransport) -> None:
    fake.max_attempts = 2
    for i in range(5):
        _fail(fake, f"s{i}", i % 3)
    del fake.failed_attempts["s0"]
    found = list(client.failures("cp", page_size=2))
    assert [(f.source_id, f.attempts, f.failed) for f in found] == [
        ("s1", 1, False),
        ("s2", 2, True),
        ("s3", 0, False),
        ("s4", 1, False),
    ]
    assert found[1].last_reason == "reason 1" and found[1].recent[0].reason == "reason 0"
    assert [a[3] for a in fake.args["list_failures"]] == ["", "s2"]
    failed = list(client.failures("cp", failed_only=True))
    assert [f.source_id for f in failed] == ["s2"]


def test_failures_of_named_sources_in_url_sized_chunks(
    client: Client, fake: FakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calls, "FAILURES_QUERY_BYTES", 100)
    fake.max_attempts = 1
    ids = [f"source-{i:03d}" for i in range(30)]
    _fail(fake, "source-007", 1)
    found = list(client.failures("cp", source_ids=iter(ids), failed_only=True))
    assert [f.source_id for f in found] == ["source-007"]
    sent = [a[1] for a in fake.args["list_failures"]]
    assert len(sent) > 1 and [sid for chunk in sent for sid in chunk] == ids
    for chunk in sent:
        query = urllib.parse.urlencode([("source_id", s) for s in chunk])
        assert len(query) <= 100
    assert all(a[2] for a in fake.args["list_failures"])  # failed_only on every call


def test_failures_of_no_sources_makes_no_call(client: Client, fake: FakeTransport) -> None:
    assert list(client.failures("cp", source_ids=[])) == []
    with pytest.raises(tally.InvalidArgument, match="single str"):
        client.failures("cp", source_ids="abc")
    with pytest.raises(tally.InvalidArgument, match="source_id"):
        client.failures("cp", source_ids=["a", ""])
    assert fake.calls == []


def test_query_chunks_respect_the_id_count_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "FAILURES_CHUNK", 3)
    assert calls.query_chunks(list("abcdefg")) == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert calls.query_chunks([]) == []


def test_retry_failed_all_some_or_none(client: Client, fake: FakeTransport) -> None:
    for sid in "abc":
        _fail(fake, sid, 2)
    assert client.retry_failed("cp", ["a", "zz"]) == 1
    assert client.retry_failed("cp", []) == 0  # an empty list clears nothing, and calls nothing
    assert fake.args["retry_failed"] == [("cp", ("a", "zz"))]
    assert client.retry_failed("cp") == 2
    assert fake.args["retry_failed"][-1] == ("cp", ())
    assert fake.failed_attempts == {}


def test_async_client_failures_retry_and_budget() -> None:
    fake = FakeTransport()
    fake.failures_page = 1
    for sid in ("a", "b"):
        _fail(fake, sid, 2)

    async def main() -> tuple[int, list[str], list[str], int]:
        async with make_async_client(fake) as client:
            failed_now = await client.set_max_attempts("cp", 2)
            listed = [f.source_id async for f in client.failures("cp", failed_only=True)]
            named = [f.source_id async for f in client.failures("cp", source_ids=["b", "x"])]
            return failed_now, listed, named, await client.retry_failed("cp")

    assert asyncio.run(main()) == (2, ["a", "b"], ["b"], 2)


def test_a_failures_cursor_going_backwards_is_internal(client: Client, fake: FakeTransport) -> None:
    fake.list_failures = lambda call, timeout: FailurePage((), "a", 0)  # type: ignore[method-assign]
    with pytest.raises(tally.Internal, match="backwards"):
        list(client.failures("cp"))


# ------------------------------------------------------------------ wires


def test_grpc_routes_convert_both_ways() -> None:
    routes = grpc_convert.ROUTES
    req = routes[calls.ReportFailure].request(calls.ReportFailure("h1", "a", "boom", "w1"))
    assert (req.handle, req.source_id, req.reason) == ("h1", "a", "boom")
    report = routes[calls.ReportFailure].read(
        pb.ReportFailureResponse(attempts=2, failed=True, max_attempts=2)
    )
    assert report == tally.FailureReport(2, True, 2)

    listing = routes[calls.ListFailures].request(calls.ListFailures("cp", ("a", "b"), True, "x", 7))
    assert (list(listing.source_ids), listing.failed_only, listing.after, listing.limit) == (
        ["a", "b"],
        True,
        "x",
        7,
    )
    answer = pb.ListFailuresResponse(
        sources=[
            pb.SourceFailures(
                source_id="a",
                attempts=2,
                failed=True,
                recent=[pb.FailedAttempt(reason="r1", at=1.5, writer_id="w1"), pb.FailedAttempt(reason="r2")],
            )
        ],
        next_after="a",
        max_attempts=2,
    )
    page = routes[calls.ListFailures].read(answer)
    assert page == FailurePage(
        (
            tally.SourceFailures(
                "a", 2, True, (tally.FailedAttempt("r1", 1.5, "w1"), tally.FailedAttempt("r2", 0.0, ""))
            ),
        ),
        "a",
        2,
    )
    assert page.sources[0].last_reason == "r2"

    retry = routes[calls.RetryFailed].request(calls.RetryFailed("cp", ("a",)))
    assert (retry.checkpoint, list(retry.source_ids)) == ("cp", ["a"])
    assert routes[calls.RetryFailed].read(pb.RetryFailedResponse(cleared=3)) == 3
    budget = routes[calls.SetFailureBudget].request(calls.SetFailureBudget("cp", 4))
    assert (budget.checkpoint, budget.max_attempts) == ("cp", 4)
    read = routes[calls.SetFailureBudget].read(pb.SetFailureBudgetResponse(max_attempts=4, failed_sources=1))
    assert read == calls.FailureBudget(4, 1)


def test_grpc_status_carries_the_failure_fields() -> None:
    status = grpc_convert.checkpoint_from_pb(pb.CheckpointStatus(name="cp", failed_sources=3, max_attempts=2))
    assert (status.failed_sources, status.max_attempts) == (3, 2)


def test_http_routes_follow_the_json_contract() -> None:
    routes = http_convert.ROUTES
    report = routes[calls.ReportFailure]
    call = calls.ReportFailure("h/1", "a", "boom", "w1", "att-1")
    assert (report.method, report.path(call), report.body(call)) == (
        "POST",
        "/v1/writers/h%2F1/failures",
        {"source_id": "a", "reason": "boom", "attempt_id": "att-1"},
    )
    assert report.read({"attempts": 2, "failed": True, "max_attempts": 2}) == tally.FailureReport(2, True, 2)

    listing = routes[calls.ListFailures]
    path = listing.path(calls.ListFailures("cp/a", ("s 1", "s&2"), True, "x", 5))
    assert listing.method == "GET" and listing.body(calls.ListFailures("cp")) is None
    assert path.startswith("/v1/failures?")
    assert urllib.parse.parse_qsl(path.split("?", 1)[1]) == [
        ("checkpoint", "cp/a"),
        ("source_id", "s 1"),
        ("source_id", "s&2"),
        ("failed_only", "true"),
        ("after", "x"),
        ("limit", "5"),
    ]
    assert listing.path(calls.ListFailures("cp")) == "/v1/failures?checkpoint=cp"
    body = {
        "sources": [
            {
                "source_id": "a",
                "attempts": 1,
                "failed": False,
                "recent": [{"reason": "r", "at": 1.5, "writer_id": "w1"}],
            }
        ],
        "next_after": "",
        "max_attempts": 0,
    }
    assert listing.read(body) == FailurePage(
        (tally.SourceFailures("a", 1, False, (tally.FailedAttempt("r", 1.5, "w1"),)),), "", 0
    )

    retry = routes[calls.RetryFailed]
    assert (retry.method, retry.path(calls.RetryFailed("cp")), retry.body(calls.RetryFailed("cp"))) == (
        "POST",
        "/v1/failures/retry",
        {"checkpoint": "cp", "source_ids": []},
    )
    assert retry.read({"cleared": 2}) == 2
    budget = routes[calls.SetFailureBudget]
    call_b = calls.SetFailureBudget("cp", 3)
    assert (budget.method, budget.path(call_b), budget.body(call_b)) == (
        "POST",
        "/v1/failures/budget",
        {"checkpoint": "cp", "max_attempts": 3},
    )
    assert budget.read({"max_attempts": 3, "failed_sources": 1}) == calls.FailureBudget(3, 1)


def test_http_status_carries_the_failure_fields() -> None:
    status = http_convert.checkpoint_from_json({"name": "cp", "failed_sources": 3, "max_attempts": 2})
    assert (status.failed_sources, status.max_attempts) == (3, 2)
    old = http_convert.checkpoint_from_json({"name": "cp"})  # an older coordinator
    assert (old.failed_sources, old.max_attempts) == (0, 0)
