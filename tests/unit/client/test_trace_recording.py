"""Recording traces: the recorder's file handling, ``TALLY_TRACE`` and ``trace=``, and the NeMo Curator
drop-in passing the driver's choice to its actor (a fake transport and a fake Ray, as in
``test_nemo_integration``; recordings against a real server are in ``tests/integration/test_trace.py``)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tally._calls import BatchAnswer
from tally._trace import TraceRecorder
from tally._types import ApplyCounts, Delta, OpenedWriter, WriterSpec
from tally.errors import InvalidArgument
from tally.integrations.nemo_curator import TallyResumabilityProxy, tally_for_nemo_curator
from tally.replay import read_trace, replay
from tests.unit.client import test_nemo_integration as nemo
from tests.unit.client.tally_fakes import FakeTransport, make_client, wait_state
from tests.unit.client.test_nemo_integration import ADDRESS, FakeRay

# The drop-in's fixtures: a fake transport, proxies' clients over it, and a fake Ray.
fake = nemo.fake
clients = nemo.clients
fake_ray = nemo.fake_ray
state_api = nemo.state_api


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_from_many_threads_are_whole_lines_numbered_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recorders = [TraceRecorder(str(path), f"w{i}") for i in range(2)]  # two "processes", one file

    def work(recorder: TraceRecorder, n: int) -> None:
        for k in range(200):
            recorder.record("apply_deltas", per_task=[[f"t{n}-{k}", "s" * 500, 1]])

    threads = [threading.Thread(target=work, args=(recorders[n % 2], n)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for recorder in recorders:
        recorder.close()
        recorder.record("close")  # ignored once closed; never raises
    found = rows(path)
    assert len(found) == 1600
    for writer in ("w0", "w1"):
        seqs = [row["seq"] for row in found if row["writer"] == writer]
        assert seqs == list(range(1, 801))
    assert {row["method"] for row in found} == {"apply_deltas"}


def test_a_trace_that_stops_being_writable_is_switched_off_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = TraceRecorder(str(tmp_path / "t.jsonl"), "w")
    assert recorder._fd is not None
    os.close(recorder._fd)  # as if the disk went away: every write fails
    with caplog.at_level(logging.WARNING, logger="tally._writer"):
        recorder.record("wait", result=0)
        recorder.record("wait", result=0)
    assert [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert recorder._fd is None


def test_no_trace_unless_asked(fake: FakeTransport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TALLY_TRACE", raising=False)
    client = make_client(fake)
    assert client.writer("cp")._trace is None
    monkeypatch.setenv("TALLY_TRACE", str(tmp_path / "env-{writer_id}.jsonl"))
    traced = client.writer("cp", writer_id="w1")
    assert traced._trace is not None and traced._trace.path == str(tmp_path / "env-w1.jsonl")
    assert client.writer("cp", trace="")._trace is None  # "" turns it off whatever TALLY_TRACE says
    with pytest.raises(InvalidArgument, match=r"TALLY_TRACE='/nonexistent/.*': cannot open the trace file"):
        monkeypatch.setenv("TALLY_TRACE", "/nonexistent/dir/t.jsonl")
        client.writer("cp")
    traced._trace.close()
    client.close()


def test_a_refused_call_is_recorded_with_its_error(fake: FakeTransport, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    client = make_client(fake)
    w = client.writer("cp", writer_id="w1", trace=path)
    w.open()
    w.apply_deltas([("t", "s", 1)])
    w.apply_deltas([("t", "s", "one")])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        w.close()
    client.close()
    found = rows(path)
    assert [row["method"] for row in found][:3] == ["open", "apply_deltas", "apply_deltas"]
    assert found[2]["per_task"] == [] and "delta" in found[2]["error"]
    assert found[-1]["method"] == "close" and "error" in found[-1]


def test_batch_rows_follow_the_order_batches_were_applied_not_the_order_answers_came_back(
    fake: FakeTransport, tmp_path: Path
) -> None:
    """Two batches on the wire: the second's answer comes back first. Found in CI, where a
    real writer's trace replayed with two mismatches; the trace must hold batch rows in the order
    the coordinator applied them, which is the only order replay can follow."""
    path = tmp_path / "t.jsonl"
    client = make_client(fake, max_batch=2)
    w = client.writer("cp", writer_id="w1", trace=path)
    opened = fake.open_writer

    def open_two_in_flight(spec: WriterSpec, timeout: float) -> OpenedWriter:
        return dataclasses.replace(opened(spec, timeout), max_batches_in_flight=2)

    def apply(handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float) -> BatchAnswer:
        if batch_seq == 1:  # answered only once the second batch's answer is taken
            wait_state(w, lambda: w._core.batches_sent >= 1)
        completed = sum(d < 0 for _, _, d in deltas)  # each batch here completes what it closes
        return BatchAnswer(ApplyCounts(applied=len(deltas), completed=completed))

    fake.open_writer = open_two_in_flight  # type: ignore[method-assign]
    fake.apply_deltas = apply  # type: ignore[method-assign]
    w.open()
    w.apply_deltas([("t1", "a", 1), ("t2", "a", -1), ("t3", "b", 1), ("t4", "c", 1)])
    w.flush()
    w.close()
    client.close()
    batches = [row for row in rows(path) if row["method"] == "batch"]
    assert [(row["batch_seq"], row["counts"]["completed"]) for row in batches] == [(1, 1), (2, 0)]
    [run] = replay(read_trace(path))  # (the fake's close reports no totals: only batches compared)
    assert [s.line for s in run.mismatches if s.method == "batch"] == [] and run.completed == ["a"]


def test_the_drop_in_passes_the_drivers_trace_to_its_actor(
    fake: FakeTransport,
    clients: list[tuple[Any, ...]],
    fake_ray: FakeRay,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("TALLY_TRACE", str(tmp_path / "driver.jsonl"))
    with tally_for_nemo_curator("cp", ADDRESS, writer_id="w1"):
        assert fake_ray.nemo_run() == [False, False]
    methods = [row["method"] for row in rows(tmp_path / "driver.jsonl")]
    # The block waits for the actor, then NeMo Curator does (as in the recording: two waits).
    assert methods == ["open", "wait", "wait", "are_completed", "apply_deltas", "batch", "close"]
    [run] = replay(read_trace(tmp_path / "driver.jsonl"))
    assert run.mismatches == [] and run.pending == {"b": 1}

    monkeypatch.delenv("TALLY_TRACE")

    class Elsewhere(TallyResumabilityProxy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            os.chdir(tmp_path / "actor")  # the actor's working directory is not the driver's
            super().__init__(*args, **kwargs)

    (tmp_path / "actor").mkdir()
    monkeypatch.setattr(nemo.nemo_curator, "TallyResumabilityProxy", Elsewhere)
    monkeypatch.chdir(tmp_path)
    with tally_for_nemo_curator("cp", ADDRESS, writer_id="w2", trace="given.jsonl"):
        fake_ray.nemo_run()
    assert rows(tmp_path / "given.jsonl")[0]["writer"] == "w2"
    assert not (tmp_path / "actor" / "given.jsonl").exists()


def test_the_actor_ignores_its_own_environment(
    fake: FakeTransport, clients: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The Ray worker's TALLY_TRACE is not this run's choice: only trace= (from the driver) counts.
    monkeypatch.setenv("TALLY_TRACE", str(tmp_path / "worker.jsonl"))
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    proxy.wait()
    proxy.close()
    assert not (tmp_path / "worker.jsonl").exists()


def test_a_recorder_dropped_without_close_releases_its_file(tmp_path: Path) -> None:
    recorder = TraceRecorder(str(tmp_path / "t.jsonl"), "w")
    fd = recorder._fd
    assert fd is not None
    os.fstat(fd)
    del recorder
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
