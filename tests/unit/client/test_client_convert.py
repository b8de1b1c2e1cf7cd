"""Wire conversion: proto3 zero values and sparse JSON read as defaults; malformed JSON is refused."""

from __future__ import annotations

import pytest

import tally
from tally import _convert as convert
from tally._types import WriterSpec
from tally.v1 import coordinator_pb2 as pb


def test_empty_messages_read_as_zero_values() -> None:
    status = convert.checkpoint_from_pb(pb.CheckpointStatus())
    assert status == tally.CheckpointStatus("", 0, 0, 0, 0, 0, 0, 0.0, 0.0, (), {})
    assert convert.close_result_from_pb(pb.CloseWriterResponse()) == tally.CloseResult()
    assert convert.apply_counts_from_pb(pb.ApplyDeltasResponse()) == tally.ApplyCounts()
    assert convert.completed_from_pb(pb.AreCompletedResponse()) == []


def test_requests_carry_every_field() -> None:
    spec = WriterSpec("cp", "w", {"a": "1"}, {"b": "2"}, "h", 9)
    req = convert.open_writer_request(spec)
    assert (req.checkpoint, req.writer_id, req.host, req.pid) == ("cp", "w", "h", 9)
    assert dict(req.fingerprint) == {"a": "1"} and dict(req.labels) == {"b": "2"}
    batch = convert.apply_deltas_request("h1", [("t", "s", -3)], 12)
    assert batch.handle == "h1" and batch.batch_seq == 12 and batch.deltas[0].delta == -3


def test_sparse_json_reads_as_defaults() -> None:
    status = convert.checkpoint_from_json({"name": "cp", "writers": [{"writer_id": "w"}]})
    assert status.completed_count == 0 and status.fingerprint == {}
    assert status.writers[0].counts == tally.ApplyCounts() and status.writers[0].labels == {}
    assert convert.close_result_from_json({}) == tally.CloseResult()
    assert convert.checkpoints_from_json({}) == []


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (convert.opened_from_json, {}),
        (convert.opened_from_json, []),
        (convert.completed_from_json, {"completed": [1, 0]}),
        (convert.checkpoint_from_json, {"name": "x", "completed_count": "many"}),
        (convert.apply_counts_from_json, {"counts": "all"}),
    ],
)
def test_malformed_json_raises(parse: object, body: object) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        parse(body)  # type: ignore[operator]


def test_open_body_omits_empty_optionals() -> None:
    spec = WriterSpec("cp", "w", {}, {}, "h", 1)
    assert convert.open_writer_body(spec) == {"checkpoint": "cp", "writer_id": "w", "host": "h", "pid": 1}
