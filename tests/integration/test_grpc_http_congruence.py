"""The same scenario over gRPC and over HTTP must end in the same state: one fixed scenario through
the SDK's two transports, and generated ones call by call over the server's two transports."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1.coordinator_pb2_grpc import CoordinatorStub
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import nemo_read, tree


def scenario(address: str) -> dict[str, Any]:
    """Two writers, retries, a rewrite, a filtered tree, an anomaly and an unfinished source."""
    checkpoint = "congruence/run"
    with tally.Client(address) as client:
        with client.writer(checkpoint, writer_id="task-0", labels={"array_task": "0"}) as w0:
            w0.apply_deltas(tree("a") + tree("b"))
            w0.apply_deltas(tree("a"))  # retried tasks: all skipped
            w0.apply_deltas([("0_c", "c", 1), ("0_c_0", "c", 2)])
            w0.apply_deltas([("0_c_0", "c", 0), ("0_c_0_0", "c", -1)])  # rewrite, then the sink
            w0.apply_deltas([("0_d", "d", 1)])  # never finishes
        closed0 = w0.close()
        with client.writer(checkpoint, writer_id="task-1") as w1:
            before = w1.are_completed(["a", "b", "c", "d", "e"])
            w1.apply_deltas(tree("e"))
            w1.apply_deltas([("0_a_9", "a", -1)])  # a late delta for a completed source: anomaly
            w1.flush()
            status = client.checkpoint(checkpoint)
        closed1 = w1.close()
        after = client.are_completed(checkpoint, ["a", "b", "c", "d", "e"])
        final = client.checkpoint(checkpoint)
    return {
        "before": before,
        "after": after,
        "closed0": (closed0.counts, closed0.incomplete_sources),
        "closed1": (closed1.counts, closed1.incomplete_sources),
        "live": (status.completed_count, status.live_writers, status.anomalies, status.pending_sources),
        "final": (final.completed_count, final.live_writers, final.anomalies, final.pending_sources),
    }


def test_grpc_and_http_end_in_the_same_state(tmp_path: Path) -> None:
    results = {}
    files = {}
    for transport in ("grpc", "http"):
        data = tmp_path / transport
        with running_server(data, settle_ms=0) as server:
            address = server.grpc_address if transport == "grpc" else server.http_url
            results[transport] = scenario(f"{transport}://{address.removeprefix('http://')}")
        files[transport] = nemo_read(data / "checkpoints" / "congruence" / "run")
    assert results["grpc"] == results["http"]
    assert files["grpc"] == files["http"] == {"b", "c", "e"}
    assert results["grpc"]["before"] == [True, True, True, False, False]
    assert results["grpc"]["closed0"][1] == ("d",)
    assert results["grpc"]["final"] == (3, 0, 1, 0)


def test_http_transport_reports_server_refusals(server: RunningServer) -> None:
    with tally.Client(server.http_url) as client:
        try:
            client.are_completed("../escape", ["a"])
        except tally.InvalidArgument as exc:
            assert "checkpoint name" in str(exc)
        else:
            raise AssertionError("an escaping checkpoint name was accepted over HTTP")


# --- generated scenarios, call by call over the raw wire -------------------------------------------
#
# The same short sequence of calls goes to one checkpoint over gRPC and to another over HTTP, on one
# real server; every answer (or refusal code) and the final state must be the same. Raw calls, not
# the SDK: each apply is exactly one batch, so the counting rules see the same batches on both.

Answer = tuple[str, Any]  # ("ok", normalized reply) or ("refused", status code name)
WRITERS = ("w0", "w1")
SOURCES = ("a", "b", "c")


def _counts(c: Any) -> tuple[int, ...]:
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
    return tuple(int(get(k)) for k in ("applied", "skipped", "rewritten", "anomalies", "completed"))


def _writer(w: Any) -> tuple[Any, ...]:
    get = w.get if isinstance(w, dict) else lambda k: getattr(w, k)
    return (get("writer_id"), get("state"), int(get("pending_sources")), _counts(get("counts")))


def _event(e: Any) -> tuple[Any, ...]:
    # The message names the checkpoint, which differs between the two runs; the severity must not.
    get = e.get if isinstance(e, dict) else lambda k: getattr(e, k)
    return (get("kind"), get("severity"), get("writer_id"))


def _status(s: Any) -> dict[str, Any]:
    get = s.get if isinstance(s, dict) else lambda k: getattr(s, k)
    fields = ("completed_count", "live_writers", "pending_sources", "settling_sources", "anomalies")
    return {
        **{f: int(get(f)) for f in fields},
        "fingerprint": dict(get("fingerprint")),
        "writers": [_writer(w) for w in get("writers")],
    }


class GrpcWire:
    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def call(self, method: str, request: Any, reply: Callable[[Any], Any]) -> Answer:
        try:
            return "ok", reply(getattr(self._stub, method)(request, timeout=30))
        except grpc.RpcError as err:
            return "refused", err.code().name  # type: ignore[attr-defined]

    def open(self, checkpoint: str, writer_id: str, fingerprint: dict[str, str]) -> tuple[Answer, str]:
        request = pb.OpenWriterRequest(checkpoint=checkpoint, writer_id=writer_id, fingerprint=fingerprint)
        handles: list[str] = []

        def reply(r: Any) -> Any:
            handles.append(r.handle)
            return (r.writer_id, r.completed_count, r.settle_ms)

        return self.call("OpenWriter", request, reply), (handles or [""])[0]

    def apply(self, handle: str, deltas: list[tuple[str, str, int]]) -> Answer:
        request = pb.ApplyDeltasRequest(
            handle=handle, deltas=[pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in deltas]
        )
        return self.call("ApplyDeltas", request, lambda r: _counts(r.counts))

    def flush(self, handle: str) -> Answer:
        return self.call("Flush", pb.FlushRequest(handle=handle), lambda r: r.completed)

    def close_writer(self, handle: str) -> Answer:
        return self.call(
            "CloseWriter",
            pb.CloseWriterRequest(handle=handle),
            lambda r: (_counts(r.counts), list(r.incomplete_sources), r.incomplete_count),
        )

    def are_completed(self, checkpoint: str, ids: list[str]) -> Answer:
        request = pb.AreCompletedRequest(checkpoint=checkpoint, source_ids=ids)
        return self.call("AreCompleted", request, lambda r: list(r.completed))

    def status(self, checkpoint: str) -> Answer:
        return self.call("GetCheckpoint", pb.GetCheckpointRequest(name=checkpoint), _status)

    def writers(self, checkpoint: str) -> Answer:
        request = pb.ListWritersRequest(checkpoint=checkpoint, include_closed=True)
        return self.call("ListWriters", request, lambda r: [_writer(w) for w in r.writers])

    def events(self, checkpoint: str) -> Answer:
        request = pb.ListEventsRequest(checkpoint=checkpoint, limit=1000)
        return self.call("ListEvents", request, lambda r: [_event(e) for e in r.events])


class HttpWire:
    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=30)

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, reply: Callable[[Any], Any], **kwargs: Any) -> Answer:
        response = self._http.request(method, path, **kwargs)
        if response.is_success:
            return "ok", reply(response.json())
        return "refused", response.json()["error"]["code"]

    def open(self, checkpoint: str, writer_id: str, fingerprint: dict[str, str]) -> tuple[Answer, str]:
        body = {"checkpoint": checkpoint, "writer_id": writer_id, "fingerprint": fingerprint}
        handles: list[str] = []

        def reply(r: Any) -> Any:
            handles.append(r["handle"])
            return (r["writer_id"], r["completed_count"], r["settle_ms"])

        return self.call("POST", "/v1/writers", reply, json=body), (handles or [""])[0]

    def apply(self, handle: str, deltas: list[tuple[str, str, int]]) -> Answer:
        body = {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in deltas]}
        return self.call("POST", f"/v1/writers/{handle}/deltas", lambda r: _counts(r["counts"]), json=body)

    def flush(self, handle: str) -> Answer:
        return self.call("POST", f"/v1/writers/{handle}/flush", lambda r: r["completed"])

    def close_writer(self, handle: str) -> Answer:
        return self.call(
            "POST",
            f"/v1/writers/{handle}/close",
            lambda r: (_counts(r["counts"]), r["incomplete_sources"], r["incomplete_count"]),
        )

    def are_completed(self, checkpoint: str, ids: list[str]) -> Answer:
        body = {"checkpoint": checkpoint, "source_ids": ids}
        return self.call("POST", "/v1/are-completed", lambda r: r["completed"], json=body)

    def status(self, checkpoint: str) -> Answer:
        return self.call("GET", f"/v1/checkpoints/{checkpoint}", _status)

    def writers(self, checkpoint: str) -> Answer:
        params = {"checkpoint": checkpoint, "include_closed": True}
        return self.call("GET", "/v1/writers", lambda r: [_writer(w) for w in r["writers"]], params=params)

    def events(self, checkpoint: str) -> Answer:
        params = {"checkpoint": checkpoint, "limit": 1000}
        return self.call("GET", "/v1/events", lambda r: [_event(e) for e in r["events"]], params=params)


Wire = GrpcWire | HttpWire

_source = st.sampled_from(SOURCES)
_writer_id = st.sampled_from(WRITERS)
_delta = st.tuples(_source, st.integers(0, 3), st.integers(-1, 2)).map(
    lambda x: (f"{x[0]}_{x[1]}", x[0], x[2])
)
_deltas = st.lists(_delta, min_size=1, max_size=6)
OPERATIONS = st.one_of(
    st.tuples(st.just("open"), _writer_id, st.sampled_from([{}, {"v": "1"}, {"v": "2"}])),
    st.tuples(st.just("apply"), _writer_id, _deltas),
    st.tuples(st.just("apply"), _writer_id, _source.map(tree)),  # a whole tree: the source completes
    st.tuples(st.just("apply"), _writer_id, st.tuples(_source.map(tree), _deltas).map(lambda x: x[0] + x[1])),
    st.tuples(st.just("flush"), _writer_id),
    st.tuples(st.just("close"), _writer_id),
    st.tuples(st.just("are_completed"), st.lists(_source, min_size=1, max_size=3)),
    st.tuples(st.just("status")),
)


def play(wire: Wire, checkpoint: str, operations: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``operations`` against ``checkpoint``; every answer, then the state it ends in."""
    handles = {w: f"never-opened-{w}" for w in WRITERS}
    answers: list[Any] = []
    for op, *args in operations:
        if op == "open":
            answer, handle = wire.open(checkpoint, args[0], args[1])
            if answer[0] == "ok":
                handles[args[0]] = handle
        elif op == "apply":
            answer = wire.apply(handles[args[0]], args[1])
        elif op == "flush":
            answer = wire.flush(handles[args[0]])
        elif op == "close":
            answer = wire.close_writer(handles[args[0]])
        elif op == "are_completed":
            answer = wire.are_completed(checkpoint, args[0])
        else:
            answer = wire.status(checkpoint)
        answers.append((op, answer))
    answers.append(("end: status", wire.status(checkpoint)))
    answers.append(("end: completed", wire.are_completed(checkpoint, list(SOURCES))))
    answers.append(("end: writers", wire.writers(checkpoint)))
    answers.append(("end: events", wire.events(checkpoint)))
    for handle in handles.values():
        wire.close_writer(handle)  # leave no live writer behind (a refusal for closed ones is fine)
    return answers


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GrpcWire, HttpWire]]:
    with running_server(tmp_path_factory.mktemp("congruence") / "data", settle_ms=0) as server:
        wires = GrpcWire(server.grpc_address), HttpWire(server.http_url)
        try:
            yield wires
        finally:
            for wire in wires:
                wire.close()


_examples = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Each scenario starts with w0 open, so that the calls after it do more than answer NOT_FOUND.
@given(operations=st.lists(OPERATIONS, max_size=9).map(lambda ops: [("open", "w0", {}), *ops]))
def test_generated_scenarios_answer_the_same_over_grpc_and_http(
    shared: tuple[GrpcWire, HttpWire], operations: list[tuple[Any, ...]]
) -> None:
    grpc_wire, http_wire = shared
    n = next(_examples)
    over_grpc = play(grpc_wire, f"congruent/{n}/grpc", operations)
    over_http = play(http_wire, f"congruent/{n}/http", operations)
    for step, (a, b) in enumerate(zip(over_grpc, over_http, strict=True)):
        assert a == b, (
            f"step {step} ({a[0]}) differs:\n  gRPC: {a[1]}\n  HTTP: {b[1]}\nscenario: {operations}"
        )
    # What the scenarios reach (pytest --hypothesis-show-statistics): refusals, completions, anomalies.
    for op, (outcome, value) in over_grpc[: len(operations)]:
        event(f"{op}: {value if outcome == 'refused' else 'ok'}")
    events = over_grpc[len(operations) + 3][1]
    if events[0] == "ok":
        event(f"events of severity {sorted({severity for _, severity, _ in events[1]})}")
    end = over_grpc[len(operations)][1]
    if end[0] == "ok":
        completed, anomalies = end[1]["completed_count"], end[1]["anomalies"]
        event(
            f"ends with {'some' if completed else 'no'} completed, {'some' if anomalies else 'no'} anomalies"
        )
