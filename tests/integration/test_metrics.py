"""/metrics of a real ``tally serve`` after known workloads driven through the real SDK."""

from __future__ import annotations

import platform
import re
import subprocess
import uuid
from collections.abc import Iterable

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import tally
import tally_server
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.domain import idmap
from tally_server.testing import RunningServer
from tests.conftest import system_tool
from tests.integration.workload import tree

SeriesKey = tuple[str, frozenset[tuple[str, str]]]


def scrape(server: RunningServer) -> list[Sample]:
    reply = httpx.get(f"{server.http_url}/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return [s for family in text_string_to_metric_families(reply.text) for s in family.samples]


def value(samples: Iterable[Sample], name: str, **labels: str) -> float:
    matches = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def series(samples: Iterable[Sample]) -> set[SeriesKey]:
    return {(s.name, frozenset(s.labels.items())) for s in samples}


def test_counters_and_gauges_are_exact_for_a_known_delta_stream(server: RunningServer) -> None:
    checkpoint = "metrics/exact"
    with tally.Client(server.grpc_address) as client:
        with client.writer(checkpoint, writer_id="w1") as w1:
            for sid in ("s0", "s1", "s2"):
                w1.apply_deltas(tree(sid))  # 18 applied, 3 completions
            w1.apply_deltas([("0_r", "r", 1), ("0_r_0", "r", 2)])  # 2 applied
            w1.apply_deltas([("0_r", "r", 1), ("0_r_0", "r", 2)])  # a retry: 2 skipped
            w1.apply_deltas([("0_r_0", "r", 0)])  # 1 rewritten
            w1.apply_deltas([("0_r_0_0", "r", -1)])  # 1 applied, r completes
            w1.apply_deltas(tree("p")[:-1])  # 5 applied, p stays pending
            w1.flush()
            with client.writer(checkpoint, writer_id="w2") as w2:
                w2.apply_deltas([("0_s0", "s0", 1)])  # s0 was completed when w2 opened: anomaly
                w2.flush()
                live = scrape(server)
        closed = scrape(server)

    for samples in (live, closed):
        assert value(samples, "tally_deltas_total", outcome="applied") == 26
        assert value(samples, "tally_deltas_total", outcome="skipped") == 2
        assert value(samples, "tally_deltas_total", outcome="rewritten") == 1
        assert value(samples, "tally_anomalies_total", checkpoint=checkpoint) == 1
        assert value(samples, "tally_completions_total", checkpoint=checkpoint) == 4
        assert value(samples, "tally_writers_opened_total") == 2
        assert value(samples, "tally_writers_expired_total") == 0
        # Four completions put, one source deleted by the anomaly, however they were grouped.
        assert value(samples, "tally_store_commit_batch_sources_sum") == 5
        assert value(samples, "tally_store_commit_duration_seconds_count") >= 2
        # s0 was un-completed by the anomaly.
        assert value(samples, "tally_completed_sources", checkpoint=checkpoint) == 3

    assert value(live, "tally_live_writers", checkpoint=checkpoint) == 2
    assert value(live, "tally_pending_sources", checkpoint=checkpoint) == 1  # p
    assert value(closed, "tally_live_writers", checkpoint=checkpoint) == 0
    assert value(closed, "tally_pending_sources", checkpoint=checkpoint) == 0
    # w1's distinct task ids (its retry and rewrite add none); w2's anomalous delta is not kept.
    assert value(live, "tally_remembered_tasks", checkpoint=checkpoint) == 26
    assert value(closed, "tally_remembered_tasks", checkpoint=checkpoint) == 0


def test_request_latency_is_observed_for_both_transports_with_route_templates(
    server: RunningServer,
) -> None:
    with tally.Client(server.grpc_address) as client, client.writer("metrics/grpc") as w:
        w.apply_deltas(tree("a"))
        w.flush()
    with tally.Client(server.http_url) as client, client.writer("metrics/http") as w:
        w.apply_deltas(tree("a"))
        w.flush()
    # The SDK's flush sends no Flush when the last answer said everything is durable (settle 0):
    # flush by hand on both transports.
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        stub.Flush(
            pb.FlushRequest(handle=stub.OpenWriter(pb.OpenWriterRequest(checkpoint="metrics/f")).handle)
        )
    opened = httpx.post(f"{server.http_url}/v1/writers", json={"checkpoint": "metrics/f", "writer_id": "h"})
    assert httpx.post(f"{server.http_url}/v1/writers/{opened.json()['handle']}/flush").status_code == 200
    with grpc.insecure_channel(server.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.CoordinatorStub(channel).KeepAlive(pb.KeepAliveRequest(handle="no-such-handle"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert httpx.post(f"{server.http_url}/v1/writers/no-such-handle/keepalive").status_code == 404
    assert httpx.get(f"{server.http_url}/v1/no/such/route").status_code == 404

    samples = scrape(server)
    grpc_count = "tally_grpc_request_duration_seconds_count"
    http_count = "tally_http_request_duration_seconds_count"
    for method in ("OpenWriter", "ApplyDeltas", "Flush", "CloseWriter"):
        assert value(samples, grpc_count, method=f"/tally.v1.Coordinator/{method}", code="OK") >= 1
    assert value(samples, grpc_count, method="/tally.v1.Coordinator/KeepAlive", code="NOT_FOUND") == 1
    for route in ("/v1/writers", "/v1/writers/{handle}/deltas", "/v1/writers/{handle}/flush"):
        assert value(samples, http_count, method="POST", route=route, status="200") >= 1
    keepalive = "/v1/writers/{handle}/keepalive"
    assert value(samples, http_count, method="POST", route=keepalive, status="404") == 1
    assert value(samples, http_count, method="GET", route="unmatched", status="404") == 1
    # The histograms have buckets, and the +Inf bucket counts every observation.
    opened = value(samples, grpc_count, method="/tally.v1.Coordinator/OpenWriter", code="OK")
    inf = value(
        samples,
        "tally_grpc_request_duration_seconds_bucket",
        method="/tally.v1.Coordinator/OpenWriter",
        code="OK",
        le="+Inf",
    )
    assert inf == opened
    assert value(samples, "tally_store_commit_duration_seconds_count") >= 2
    assert value(samples, "tally_store_commit_batch_sources_sum") == 2


def _round(server: RunningServer, checkpoint: str, writers: int, seen: set[str]) -> None:
    """Per transport: open, apply, flush, heartbeat, read and close ``writers`` distinct writers."""
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client:
            for _ in range(writers):
                tag = uuid.uuid4().hex[:10]
                sid, writer_id = f"src-{tag}", f"writer-{tag}"
                deltas = tree(sid)
                seen.update([sid, writer_id, *(task for task, _, _ in deltas)])
                with client.writer(checkpoint, writer_id=writer_id) as w:
                    w.apply_deltas(deltas)
                    w.flush()
                    assert w.handle is not None
                    seen.add(w.handle)
                    # Heartbeats are timed by the SDK; send one explicitly so every round has them.
                    if address == server.http_url:
                        reply = httpx.post(f"{server.http_url}/v1/writers/{w.handle}/keepalive")
                        assert reply.status_code == 200
                    else:
                        with grpc.insecure_channel(server.grpc_address) as channel:
                            stub = pb_grpc.CoordinatorStub(channel)
                            stub.KeepAlive(pb.KeepAliveRequest(handle=w.handle))
                    assert w.are_completed([sid]) == [True]
                assert client.checkpoint(checkpoint).completed_count >= 1


def test_label_sets_are_bounded_and_never_carry_ids(server: RunningServer) -> None:
    checkpoint = "metrics/cardinality"
    seen: set[str] = set()
    scrape(server)  # the scrape itself is a request: its own series exist from here on
    _round(server, checkpoint, 2, seen)
    few = series(scrape(server))
    _round(server, checkpoint, 12, seen)
    samples = scrape(server)
    many = series(samples)

    # 12 more writers, handles, sources and tasks per transport: not a single new series.
    assert many == few
    label_values = {v for s in samples for k, v in s.labels.items() if k != "le"}
    leaked = {v for v in label_values for i in seen if i in v}
    assert not leaked, f"ids in label values: {sorted(leaked)[:5]}"
    assert not [v for v in label_values if re.search(r"[0-9a-f]{32}", v)], "a handle in a label value"
    assert {s.labels["checkpoint"] for s in samples if "checkpoint" in s.labels} == {checkpoint}
    names = {s.name for s in samples}
    ours = {n for n in names if n.startswith("tally_")}
    assert ours and all(n.startswith(("tally_", "process_")) for n in names)


def test_declared_and_remaining_sources_only_for_checkpoints_with_a_total(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        client.declare("metrics/declared", ["a", "b", "c"])
        with client.writer("metrics/declared", writer_id="w") as w:
            w.apply_deltas(tree("a"))
        with client.writer("metrics/plain", writer_id="w") as w:
            w.apply_deltas(tree("x"))
    samples = scrape(server)
    assert value(samples, "tally_declared_sources", checkpoint="metrics/declared") == 3
    assert value(samples, "tally_remaining_sources", checkpoint="metrics/declared") == 2
    assert not [s for s in samples if s.labels.get("checkpoint") == "metrics/plain" and "declared" in s.name]
    assert not [s for s in samples if s.labels.get("checkpoint") == "metrics/plain" and "remaining" in s.name]


def test_completions_and_anomalies_are_counted_per_checkpoint(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        client.declare("metrics/idle", ["x"])  # known, nothing completed: a series at 0
        with client.writer("metrics/a", writer_id="w") as w:
            for sid in ("a0", "a1"):
                w.apply_deltas(tree(sid))
        with client.writer("metrics/b", writer_id="w") as w:
            w.apply_deltas(tree("b0"))
        with client.writer("metrics/b", writer_id="w2") as w:
            w.apply_deltas([("0_b0", "b0", 1)])  # b0 was completed: an anomaly of metrics/b only
            w.flush()
    samples = scrape(server)
    completions = {s.labels["checkpoint"]: s.value for s in samples if s.name == "tally_completions_total"}
    anomalies = {s.labels["checkpoint"]: s.value for s in samples if s.name == "tally_anomalies_total"}
    assert completions == {"metrics/a": 2, "metrics/b": 1, "metrics/idle": 0}
    assert anomalies == {"metrics/a": 0, "metrics/b": 1, "metrics/idle": 0}


def test_build_info_and_data_dir_space(server: RunningServer) -> None:
    samples = scrape(server)
    info = [s for s in samples if s.name == "tally_build_info"]
    assert [(s.labels, s.value) for s in info] == [
        (
            {
                "version": tally_server.__version__,
                "python": platform.python_version(),
                "ledger_core": idmap.current().name,
            },
            1,
        )
    ]
    free = value(samples, "tally_data_dir_free_bytes")
    size = value(samples, "tally_data_dir_size_bytes")
    assert 0 < free <= size


def test_the_exposition_has_no_created_series_and_passes_promtool(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client, client.writer("metrics/lint") as w:
        w.apply_deltas(tree("a"))
        w.flush()
    httpx.get(f"{server.http_url}/v1/no/such/route")  # an HTTP histogram child too
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    assert "tally_completions_total{" in text and "tally_grpc_request_duration_seconds_bucket{" in text
    assert "_created" not in text
    result = subprocess.run(
        [system_tool("promtool", "prometheus"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
