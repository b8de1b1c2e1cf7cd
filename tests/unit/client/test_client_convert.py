"""Wire conversion: proto3 zero values and sparse JSON read as defaults; malformed JSON is refused;
every call description has a route on both wires."""

from __future__ import annotations

import pytest

import tally
from tally import _calls as calls
from tally._calls import Call
from tally._transport import grpc_convert, http_convert
from tally._types import CheckpointPage, WriterSpec
from tally.v1 import coordinator_pb2 as pb


def test_empty_messages_read_as_zero_values() -> None:
    status = grpc_convert.checkpoint_from_pb(pb.CheckpointStatus())
    assert status == tally.CheckpointStatus("", 0, 0, 0, 0, 0, 0, 0.0, 0.0, (), {})
    assert grpc_convert.close_result_from_pb(pb.CloseWriterResponse()) == tally.CloseResult()
    apply, completed = grpc_convert.ROUTES[calls.ApplyDeltas], grpc_convert.ROUTES[calls.AreCompleted]
    # An answer without ``settled`` (an older coordinator) never lets a flush skip its call.
    assert apply.read(pb.ApplyDeltasResponse()) == calls.BatchAnswer(tally.ApplyCounts(), settled=False)
    assert apply.read(pb.ApplyDeltasResponse(settled=True)).settled is True
    assert http_convert.batch_answer_from_json({"counts": {}}) == calls.BatchAnswer(tally.ApplyCounts())
    assert http_convert.batch_answer_from_json({"counts": {}, "settled": True}).settled is True
    assert completed.read(pb.AreCompletedResponse()) == []


def test_requests_carry_every_field() -> None:
    spec = WriterSpec("cp", "w", {"a": "1"}, {"b": "2"}, "h", 9)
    req = grpc_convert.open_writer_request(spec)
    assert (req.checkpoint, req.writer_id, req.host, req.pid) == ("cp", "w", "h", 9)
    assert dict(req.fingerprint) == {"a": "1"} and dict(req.labels) == {"b": "2"}
    batch = grpc_convert.apply_deltas_request(calls.ApplyDeltas("h1", [("t", "s", -3)], 12))
    assert batch.handle == "h1" and batch.batch_seq == 12 and batch.deltas[0].delta == -3


def test_sparse_json_reads_as_defaults() -> None:
    status = http_convert.checkpoint_from_json({"name": "cp", "writers": [{"writer_id": "w"}]})
    assert status.completed_count == 0 and status.fingerprint == {}
    assert status.writers[0].counts == tally.ApplyCounts() and status.writers[0].labels == {}
    assert http_convert.close_result_from_json({}) == tally.CloseResult()
    assert http_convert.checkpoints_from_json({}) == CheckpointPage((), "")
    assert http_convert.writers_from_json({"writers": [{"writer_id": "w"}]}).next_after == ""


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (http_convert.opened_from_json, {}),
        (http_convert.opened_from_json, []),
        (http_convert.completed_from_json, {"completed": [1, 0]}),
        (http_convert.checkpoint_from_json, {"name": "x", "completed_count": "many"}),
        (http_convert.batch_answer_from_json, {"counts": "all"}),
    ],
)
def test_malformed_json_raises(parse: object, body: object) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        parse(body)  # type: ignore[operator]


def test_open_body_omits_empty_optionals() -> None:
    spec = WriterSpec("cp", "w", {}, {}, "h", 1, session_token="")
    assert http_convert.open_writer_body(spec) == {
        "checkpoint": "cp",
        "writer_id": "w",
        "host": "h",
        "pid": 1,
    }


def test_every_writer_presents_its_own_session_token() -> None:
    first, second = WriterSpec("cp", "w", {}, {}, "h", 1), WriterSpec("cp", "w", {}, {}, "h", 1)
    assert len(first.session_token) == 32 and first.session_token != second.session_token
    assert http_convert.open_writer_body(first)["session_token"] == first.session_token
    assert grpc_convert.open_writer_request(first).session_token == first.session_token


def test_new_messages_read_zero_values_as_nothing() -> None:
    assert grpc_convert.writer_status_from_pb(pb.WriterStatus()).closed_at == 0.0
    assert grpc_convert.event_page_from_pb(pb.ListEventsResponse()) == tally.EventPage((), None)
    assert grpc_convert.progress_from_pb(pb.GetProgressResponse()) == []
    page = grpc_convert.completed_page_from_pb(pb.ListCompletedResponse())
    assert (page.source_ids, page.next_after) == ((), "")
    assert grpc_convert.import_result_from_pb(pb.ImportCompletedResponse()) == tally.ImportResult(0, 0)
    assert grpc_convert.reset_result_from_pb(pb.ResetCheckpointResponse()) == tally.ResetResult("", 0, 0)


@pytest.mark.parametrize(
    ("data_json", "data"),
    [
        ("", {}),
        ('{"source_id": "s", "old": 1, "new": -1}', {"source_id": "s", "old": 1, "new": -1}),
        ("[1, 2]", {"value": [1, 2]}),  # not an object: kept, not dropped
        ("{broken", {"raw": "{broken"}),
    ],
)
def test_event_data_json_becomes_a_dict(data_json: str, data: dict[str, object]) -> None:
    event = grpc_convert.event_from_pb(pb.Event(id=3, kind="anomaly", data_json=data_json))
    assert event.data == data and event.id == 3


def test_requests_of_the_status_calls() -> None:
    assert grpc_convert.ROUTES[calls.ListEvents].request(calls.ListEvents("cp", 5, None)).before_id == 0
    assert grpc_convert.ROUTES[calls.GetProgress].request(calls.GetProgress("cp", None)).since == 0.0
    assert http_convert.list_events_query("cp", 5, None) == {"checkpoint": "cp", "limit": "5"}
    assert http_convert.list_writers_query("cp", False, 3)["include_closed"] == "false"
    assert http_convert.list_writers_query("cp", True, 3, "live/w1")["after"] == "live/w1"
    assert http_convert.list_checkpoints_query("", 7) == {"limit": "7"}
    assert http_convert.list_checkpoints_query("", 0) == {}
    assert http_convert.list_checkpoints_query("a/b", 7) == {"after": "a/b", "limit": "7"}
    request = grpc_convert.ROUTES[calls.ListWriters].request(calls.ListWriters("cp", True, 4, "ended/1.5/w"))
    assert (request.after, request.limit) == ("ended/1.5/w", 4)
    request = grpc_convert.ROUTES[calls.ListCheckpoints].request(calls.ListCheckpoints("a", 2))
    assert (request.after, request.limit) == ("a", 2)
    assert http_convert.list_completed_query("cp", "", 9) == {"checkpoint": "cp", "limit": "9"}
    assert http_convert.import_completed_body("cp", ("a",), "i") == {
        "checkpoint": "cp",
        "source_ids": ["a"],
        "import_id": "i",
    }


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (http_convert.event_page_from_json, {"events": [{"kind": "no id"}]}),
        (http_convert.event_page_from_json, {"events": [{"id": 1, "data": "text"}]}),
        (http_convert.completed_page_from_json, {"source_ids": [1, 2]}),
        (http_convert.import_result_from_json, {"imported": 1}),
        (http_convert.progress_from_json, {"samples": [{"at": 1.0}]}),
    ],
)
def test_malformed_status_json_raises(parse: object, body: object) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        parse(body)  # type: ignore[operator]


def _descriptions() -> list[type[Call[object]]]:
    return [
        cls
        for cls in vars(calls).values()
        if isinstance(cls, type) and issubclass(cls, Call) and cls is not Call
    ]


def test_every_call_description_has_a_route_on_each_wire() -> None:
    described = set(_descriptions())
    assert len(described) == 25
    assert set(grpc_convert.ROUTES) == described
    assert set(http_convert.ROUTES) == described


def test_only_reset_is_never_retried() -> None:
    assert [cls.__name__ for cls in _descriptions() if not cls.retry] == ["ResetCheckpoint"]


@pytest.mark.parametrize(
    ("sent", "severity"),
    [
        ("error", tally.Severity.ERROR),
        ("warning", tally.Severity.WARNING),
        ("info", tally.Severity.INFO),
        ("", tally.Severity.INFO),  # a server older than the field
        ("critical", tally.Severity.INFO),  # a level of a newer server
    ],
)
def test_both_wires_read_the_same_severity(sent: str, severity: tally.Severity) -> None:
    # The kind is a problem on purpose: the SDK reads the severity the server sent, never the kind.
    over_grpc = grpc_convert.event_from_pb(pb.Event(id=1, kind="unreadable_file", severity=sent))
    over_http = http_convert.event_from_json({"id": 1, "kind": "unreadable_file", "severity": sent})
    assert over_grpc == over_http and over_grpc.severity is severity
    assert http_convert.event_from_json({"id": 1, "kind": "unreadable_file"}).severity is tally.Severity.INFO


def test_severities_rank_info_warning_error() -> None:
    info, warning, error = tally.Severity.INFO, tally.Severity.WARNING, tally.Severity.ERROR
    assert [s.rank for s in (info, warning, error)] == [0, 1, 2]
    assert error.at_least(warning) and warning.at_least(warning) and not info.at_least(warning)
    assert tally.Severity("warning") == "warning"  # a str, as the wire spells it


def test_both_wires_read_declared_totals() -> None:
    grpc_status = grpc_convert.checkpoint_from_pb(
        pb.CheckpointStatus(total=10, remaining=4, completed_count=6)
    )
    http_status = http_convert.checkpoint_from_json(
        {"name": "", "total": 10, "remaining": 4, "completed_count": 6}
    )
    for status in (grpc_status, http_status):
        assert (status.total, status.remaining, status.percent) == (10, 4, 60.0)
    # A coordinator older than totals: no total, remaining not known (never "0 remaining").
    for status in (
        grpc_convert.checkpoint_from_pb(pb.CheckpointStatus()),
        http_convert.checkpoint_from_json({"name": ""}),
    ):
        assert (status.total, status.remaining, status.percent) == (0, -1, None)
    # A count declared: a total, remaining not known yet.
    assert grpc_convert.checkpoint_from_pb(pb.CheckpointStatus(total=5, remaining=-1)).remaining == -1


def test_declare_and_remaining_requests_on_both_wires() -> None:
    declare = calls.DeclareSources("cp", ("a", "b"), 0)
    req = grpc_convert.ROUTES[calls.DeclareSources].request(declare)
    assert (req.checkpoint, list(req.source_ids), req.count) == ("cp", ["a", "b"], 0)
    answer = grpc_convert.ROUTES[calls.DeclareSources].read(pb.DeclareSourcesResponse(total=2, remaining=1))
    assert answer == calls.Declared(2, 1)
    route = http_convert.ROUTES[calls.DeclareSources]
    assert (route.method, route.path(declare)) == ("POST", "/v1/declare")
    assert route.body(declare) == {"checkpoint": "cp", "source_ids": ["a", "b"], "count": 0}
    assert route.read({"total": 7, "remaining": 3}) == calls.Declared(7, 3)
    listing = calls.ListRemaining("c p", "x", 5)
    req2 = grpc_convert.ROUTES[calls.ListRemaining].request(listing)
    assert (req2.checkpoint, req2.after, req2.limit) == ("c p", "x", 5)
    page = grpc_convert.ROUTES[calls.ListRemaining].read(
        pb.ListRemainingResponse(source_ids=["y"], next_after="")
    )
    assert (page.source_ids, page.next_after) == (("y",), "")
    http_route = http_convert.ROUTES[calls.ListRemaining]
    path = http_route.path(listing)
    assert (
        path.startswith("/v1/remaining?")
        and "checkpoint=c" in path
        and "after=x" in path
        and "limit=5" in path
    )
    assert http_route.read({"source_ids": ["y"], "next_after": "y"}).next_after == "y"
