"""A batch sent as three parallel columns (issue #10): the same batch as one message per delta,
refused the same way when it is wrong, and what the SDK sends when the coordinator reads it."""

from __future__ import annotations

import json
from unittest.mock import ANY

import grpc
import httpx
import pytest

import tally
from tally import _calls as calls
from tally._transport import grpc_convert, http_convert
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer

# Two sources: "a" completes (+1 read, +1 fan-out, -1, -1), "b" stays pending; one anomaly-free
# rewrite of a task, one resent identical delta.
BATCH = [
    ("0_a", "a", 1),
    ("0_a_0", "a", 1),
    ("0_a_0_0", "a", -1),
    ("0_a_0_1", "a", -1),
    ("0_b", "b", 1),
    ("0_b", "b", 1),  # the same delta again: skipped
    ("0_b_0", "b", 2),
    ("0_b_0", "b", 1),  # rewritten
]


def columns(batch: list[tuple[str, str, int]]) -> pb.DeltaColumns:
    return pb.DeltaColumns(
        task_ids=[t for t, _, _ in batch],
        source_ids=[s for _, s, _ in batch],
        deltas=[d for _, _, d in batch],
    )


def open_writer(stub: pb_grpc.CoordinatorStub, checkpoint: str) -> pb.OpenWriterResponse:
    reply: pb.OpenWriterResponse = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=checkpoint, writer_id="w"))
    return reply


def refusal(stub: pb_grpc.CoordinatorStub, request: pb.ApplyDeltasRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyDeltas(request)
    return info.value.code(), info.value.details()


def test_the_coordinator_says_it_reads_columns(stub: pb_grpc.CoordinatorStub) -> None:
    assert open_writer(stub, "cols/open").accepts_delta_columns


def test_columns_count_and_complete_exactly_as_rows(stub: pb_grpc.CoordinatorStub) -> None:
    rows = open_writer(stub, "cols/rows").handle
    cols = open_writer(stub, "cols/cols").handle
    by_rows = stub.ApplyDeltas(
        pb.ApplyDeltasRequest(
            handle=rows, deltas=[pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in BATCH]
        )
    ).counts
    by_cols = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=cols, columns=columns(BATCH))).counts

    assert by_cols == by_rows
    assert (by_cols.applied, by_cols.skipped, by_cols.rewritten) == (6, 1, 1)
    for checkpoint, handle in (("cols/rows", rows), ("cols/cols", cols)):
        assert stub.Flush(pb.FlushRequest(handle=handle)).completed == 1
        done = stub.AreCompleted(pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=["a", "b"]))
        assert list(done.completed) == [True, False]


@pytest.mark.parametrize(
    ("request_of", "code", "says"),
    [
        (
            lambda h: pb.ApplyDeltasRequest(
                handle=h, deltas=[pb.Delta(task_id="0_x", source_id="x", delta=1)], columns=columns(BATCH)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "both as 1 delta and as columns; send one of the two",
        ),
        (
            lambda h: pb.ApplyDeltasRequest(
                handle=h, columns=pb.DeltaColumns(task_ids=["0_a", "0_b"], source_ids=["a"], deltas=[1, 1])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "columns differ in length (2 task_ids, 1 source_ids, 2 deltas)",
        ),
        (
            lambda h: pb.ApplyDeltasRequest(handle=h, columns=columns([*BATCH[:2], ("", "a", 1)])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "deltas[2].task_id is empty",
        ),
        (
            lambda h: pb.ApplyDeltasRequest(handle=h, columns=columns([*BATCH[:3], ("0_c", "c", 2**62)])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "deltas[3].delta 4611686018427387904 is out of range",
        ),
        (
            lambda h: pb.ApplyDeltasRequest(
                handle=h, columns=columns([(f"0_{i}", "s", 1) for i in range(100_001)])
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "100001 deltas",
        ),
    ],
    ids=["both", "lengths", "empty-id", "range", "too-many"],
)
def test_a_bad_batch_of_columns_is_refused_and_changes_nothing(
    stub: pb_grpc.CoordinatorStub, request_of: object, code: grpc.StatusCode, says: str
) -> None:
    handle = open_writer(stub, "cols/bad").handle
    assert callable(request_of)
    got_code, details = refusal(stub, request_of(handle))

    assert got_code == code
    assert says in details
    # Nothing of the refused batch was applied: the same deltas now count as new.
    counts = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, columns=columns(BATCH[:4]))).counts
    assert (counts.applied, counts.skipped) == (4, 0)


def test_the_sdk_sends_columns_only_to_a_coordinator_that_reads_them(server: RunningServer) -> None:
    call = calls.ApplyDeltas("h", BATCH, 7, columns=True)
    request = grpc_convert.apply_deltas_request(call)
    assert request.HasField("columns") and not request.deltas
    sent = request.columns
    assert list(zip(sent.task_ids, sent.source_ids, sent.deltas, strict=True)) == BATCH
    older = grpc_convert.apply_deltas_request(calls.ApplyDeltas("h", BATCH, 7))
    assert (
        not older.HasField("columns") and [(d.task_id, d.source_id, d.delta) for d in older.deltas] == BATCH
    )

    with tally.Client(server.grpc_address) as client, client.writer("cols/sdk", writer_id="w") as writer:
        assert writer._core.opened is not None and writer._core.opened.delta_columns
        writer.apply_deltas(BATCH)
        writer.flush()
        assert client.are_completed("cols/sdk", ["a", "b"]) == [True, False]


# --- over HTTP ------------------------------------------------------------------------------------


def http_columns(batch: list[tuple[str, str, int]]) -> dict[str, list[object]]:
    task_ids, source_ids, deltas = (list(c) for c in zip(*batch, strict=True))
    return {"task_ids": task_ids, "source_ids": source_ids, "deltas": deltas}


def test_over_http_columns_count_exactly_as_objects(server: RunningServer) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        opened = http.post("/v1/writers", json={"checkpoint": "hcols/cols", "writer_id": "w"}).json()
        assert opened["accepts_delta_columns"] is True
        rows = http.post("/v1/writers", json={"checkpoint": "hcols/rows", "writer_id": "w"}).json()["handle"]
        objects = [{"task_id": t, "source_id": s, "delta": d} for t, s, d in BATCH]
        by_rows = http.post(f"/v1/writers/{rows}/deltas", json={"deltas": objects, "batch_seq": 1})
        by_cols = http.post(
            f"/v1/writers/{opened['handle']}/deltas", json={"columns": http_columns(BATCH), "batch_seq": 1}
        )
        assert by_rows.status_code == by_cols.status_code == 200
        assert by_cols.json()["counts"] == by_rows.json()["counts"]
        http.post(f"/v1/writers/{opened['handle']}/flush").raise_for_status()
        done = http.post("/v1/are-completed", json={"checkpoint": "hcols/cols", "source_ids": ["a", "b"]})
        assert done.json()["completed"] == [True, False]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"columns": http_columns(BATCH[:2]), "deltas": []}, 400, "either 'deltas' or 'columns'"),
        ({"batch_seq": 1}, 400, "either 'deltas' or 'columns'"),
        (
            {"columns": {"task_ids": ["0_a", "0_b"], "source_ids": ["a"], "deltas": [1, 1]}},
            400,
            "columns differ in length (2 task_ids, 1 source_ids, 2 deltas)",
        ),
        (
            {"columns": {"task_ids": ["0_a"], "source_ids": ["a"], "deltas": [True]}},
            400,
            "body.columns.deltas.0",
        ),
        (
            {"columns": {"task_ids": [""], "source_ids": ["a"], "deltas": [1]}},
            400,
            "deltas[0].task_id is empty",
        ),
    ],
    ids=["both", "neither", "lengths", "bool", "empty-id"],
)
def test_over_http_a_bad_batch_of_columns_is_refused_and_changes_nothing(
    server: RunningServer, body: dict[str, object], status: int, says: str
) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        handle = http.post("/v1/writers", json={"checkpoint": "hcols/bad", "writer_id": "w"}).json()["handle"]
        reply = http.post(f"/v1/writers/{handle}/deltas", json=body)
        assert reply.status_code == status, reply.text
        assert says in reply.text
        counts = http.post(f"/v1/writers/{handle}/deltas", json={"columns": http_columns(BATCH[:4])}).json()
        assert (counts["counts"]["applied"], counts["counts"]["skipped"]) == (4, 0)


def test_the_sdk_sends_columns_over_http_too(server: RunningServer) -> None:
    body = http_convert.apply_deltas_body(BATCH, 3, columns=True)
    assert isinstance(body, bytes)  # plain ids: the JSON is written directly
    assert json.loads(body) == {
        "columns": {"task_ids": ANY, "source_ids": ANY, "deltas": ANY},
        "batch_seq": 3,
    }
    assert "deltas" in http_convert.apply_deltas_body(BATCH, 3)  # to an older coordinator

    with tally.Client(server.http_url) as client, client.writer("hcols/sdk", writer_id="w") as writer:
        assert writer._core.opened is not None and writer._core.opened.delta_columns
        writer.apply_deltas(BATCH)
        writer.flush()
        assert client.are_completed("hcols/sdk", ["a", "b"]) == [True, False]
