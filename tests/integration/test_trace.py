"""Traces recorded by the real SDK writer and by the NeMo Curator drop-in's proxy (without Ray) against a
real ``tally serve``, replayed by ``tally replay``: the rules complete what the coordinator completed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import tally
from tally.integrations.nemo_curator import TallyResumabilityProxy
from tally.replay import Run, read_trace, replay
from tally_server.testing import RunningServer, running_server
from tests.conftest import NEMO_TRACE, load_trace
from tests.integration.test_cli_client_only import SERVER_ONLY, loaded, tally_cli
from tests.integration.workload import tree


def replayed(path: Path) -> list[Run]:
    runs = replay(read_trace(path))
    for run in runs:
        assert run.mismatches == [], [(s.line, s.mismatch) for s in run.mismatches]
    return runs


def completed_on_server(client: tally.Client, checkpoint: str, sources: list[str]) -> set[str]:
    return {sid for sid, done in zip(sources, client.are_completed(checkpoint, sources), strict=True) if done}


def test_a_writers_trace_replays_to_what_the_coordinator_completed(
    server: RunningServer, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    sources = [f"s{i}" for i in range(24)]
    with tally.Client(server.grpc_address) as client:
        # Small batches, so that batches cut across calls and threads.
        client._config = dataclasses.replace(client._config, max_batch=7, max_buffered=20)
        with client.writer("trace/sdk", trace=trace) as w:
            assert w.are_completed(sources) == [False] * 24

            def work(part: list[str]) -> None:
                for sid in part:
                    deltas = tree(sid)
                    if sid == "s5":
                        deltas = deltas[:-1]  # never completes
                    w.apply_deltas(deltas[:3])
                    w.apply_deltas(deltas[3:])

            threads = [threading.Thread(target=work, args=(sources[i::4],)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            w.flush()
            w.apply_deltas([("late", "s0", 1)])  # s0 is completed: an anomaly un-completes it
        result = w.close()
        on_server = completed_on_server(client, "trace/sdk", sources)

    assert on_server == set(sources) - {"s0", "s5"}
    [run] = replayed(trace)
    assert run.mode == "batch" and run.settle_ms == 0 and run.checkpoint == "trace/sdk"
    assert sum(s.deltas for s in run.steps if s.method == "batch") == 24 * 6 - 1 + 1
    assert len([s for s in run.steps if s.method == "batch"]) > 4
    assert set(run.completed) - {"s0"} == on_server
    assert run.counts["completed"] == result.counts.completed == 23
    assert run.counts["anomalies"] == result.counts.anomalies == 1
    assert sorted(run.pending) == ["s5"]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [row["seq"] for row in rows] == list(range(1, len(rows) + 1))
    assert all(isinstance(row["at"], float) for row in rows)
    assert [row["at"] for row in rows] == sorted(row["at"] for row in rows)
    assert rows[-1]["method"] == "close" and rows[-1]["counts"]["completed"] == 23


def test_with_a_settle_window_the_totals_at_close_agree(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    sources = ["a", "b", "c"]
    with running_server(tmp_path / "data", settle_ms=250) as srv, tally.Client(srv.grpc_address) as client:
        with client.writer("trace/settle", trace=trace) as w:
            for sid in sources:
                w.apply_deltas(tree(sid))
            w.apply_deltas(tree("d")[:2])
            w.flush()
        on_server = completed_on_server(client, "trace/settle", [*sources, "d"])
    [run] = replayed(trace)
    assert run.settle_ms == 250
    assert set(run.completed) == on_server == set(sources)
    assert run.pending == {"d": 1}


def test_an_async_writers_trace_replays_too(server: RunningServer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"

    async def body() -> tally.CloseResult:
        async with tally.AsyncClient(server.grpc_address) as client:
            async with client.writer("trace/async", trace=trace) as w:
                await w.are_completed(["x"])
                w.apply_deltas(tree("x"))
                await w.flush()
                w.apply_deltas(tree("y")[:4])
            return await w.close()

    result = asyncio.run(body())
    [run] = replayed(trace)
    assert run.completed == ["x"]
    assert result.counts.completed == 1 and result.incomplete_count == 1


def test_the_drop_ins_trace_replays_to_the_recorded_pipelines_completions(
    server: RunningServer, tmp_path: Path
) -> None:
    # NeMo Curator's recorded calls, made on the proxy as the actor would receive them (no Ray).
    trace = tmp_path / "nemo.jsonl"
    recorded = load_trace()
    proxy = TallyResumabilityProxy(server.grpc_address, "trace/nemo", trace=str(trace))
    for row in recorded:
        if row["method"] == "wait":
            assert proxy.wait() == row["result"]
        elif row["method"] == "are_completed":
            assert proxy.are_completed(row["source_ids"]) == row["result"]
        elif row["method"] == "apply_deltas":
            proxy.apply_deltas([tuple(d) for d in row["per_task"]])
        elif row["method"] == "close":
            proxy.close()
    expected = recorded[-1]["completed"]
    with tally.Client(server.grpc_address) as client:
        assert completed_on_server(client, "trace/nemo", expected) == set(expected)

    [run] = replayed(trace)
    assert sorted(run.completed) == expected
    methods = [row["method"] for row in map(json.loads, trace.read_text().splitlines())]
    assert methods[:4] == ["open", "wait", "wait", "are_completed"]
    assert methods.count("apply_deltas") == 33 and methods[-1] == "close"
    # tally replay, as a bug report's reader runs it: exit 0, the completions listed.
    code = f"import sys; sys.argv = ['tally', 'replay', {str(trace)!r}]; from tally.cli import main; main()"
    cli = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "replayed batch by batch" in cli.stdout
    assert "4 sources completed, 0 sources pending, 36 deltas applied" in cli.stdout


def test_writers_sharing_a_trace_file_are_told_apart(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared.jsonl"
    monkeypatch.setenv("TALLY_TRACE", str(shared))
    with tally.Client(server.grpc_address) as client:
        with (
            client.writer("trace/two", writer_id="w1") as one,
            client.writer("trace/two", writer_id="w2") as two,
        ):
            for i in range(20):
                one.apply_deltas(tree(f"a{i}"))
                two.apply_deltas(tree(f"b{i}")[:-1])
        monkeypatch.setenv("TALLY_TRACE", str(tmp_path / "own-{writer_id}.jsonl"))
        with client.writer("trace/own", writer_id="w3") as three:
            three.apply_deltas(tree("c"))
        monkeypatch.delenv("TALLY_TRACE")
        with client.writer("trace/none") as untraced:
            assert untraced._trace is None
    runs = replayed(shared)
    assert [(r.writer, len(r.completed), len(r.pending)) for r in runs] == [("w1", 20, 0), ("w2", 0, 20)]
    [own] = replayed(tmp_path / "own-w3.jsonl")
    assert own.completed == ["c"]


def test_a_trace_that_cannot_be_opened_is_refused_when_the_writer_is_made(
    server: RunningServer, tmp_path: Path
) -> None:
    with tally.Client(server.grpc_address) as client:
        with pytest.raises(tally.InvalidArgument, match=r"trace=.*cannot open the trace file for appending"):
            client.writer("trace/bad", trace=tmp_path / "no-such-dir" / "t.jsonl")


def test_tally_replay_needs_only_the_sdk() -> None:
    result = tally_cli("replay", str(NEMO_TRACE), "-o", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mismatches"] == 0
    assert not [m for m in loaded(result) if m.split(".")[0] in SERVER_ONLY]
