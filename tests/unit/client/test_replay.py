"""``tally replay`` and ``tally.replay`` on NeMo Curator's recording and on hand-made traces (no server)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tally.cli.app import build_app
from tally.replay import Rules, TraceError, read_trace, replay
from tests.conftest import NEMO_TRACE, load_trace


def tally_replay(*args: str) -> Any:
    return CliRunner().invoke(build_app(), ["replay", *args])


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_fixture_replays_to_exactly_its_newly_completed_call_by_call() -> None:
    result = tally_replay(str(NEMO_TRACE))
    assert result.exit_code == 0, result.output
    printed = {}
    for line in result.output.splitlines():
        found = re.match(r"\s+(\d+)\s+apply_deltas \(\d+ deltas?\)\s+completes (.*)$", line)
        if found:
            completes = found.group(2).strip()
            printed[int(found.group(1))] = [] if completes == "-" else completes.split(", ")
    recorded = {row["seq"]: row["newly_completed"] for row in load_trace() if row["method"] == "apply_deltas"}
    assert len(recorded) == 33
    assert printed == recorded
    assert "4 sources completed, 0 sources pending, 36 deltas applied" in result.output
    assert "0 rows differ" in result.output


def test_the_fixture_as_json() -> None:
    result = tally_replay(str(NEMO_TRACE), "-o", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["mismatches"] == 0
    [run] = doc["runs"]
    assert run["mode"] == "call"
    steps = {step["seq"]: step for step in run["steps"]}
    for row in load_trace():
        if row["method"] == "apply_deltas":
            assert steps[row["seq"]]["completed"] == row["newly_completed"]
            assert steps[row["seq"]]["mismatch"] is None
    assert run["summary"]["completed"] == ["eb8f50c7806c", "38f6b8e635d1", "689ecdf417e8", "13c7168e07c4"]
    assert run["summary"]["counts"] == {
        "applied": 36,
        "skipped": 0,
        "rewritten": 0,
        "anomalies": 0,
        "completed": 4,
    }


def test_a_row_whose_newly_completed_differs_is_flagged_and_fails(tmp_path: Path) -> None:
    rows = load_trace()
    index = next(i for i, r in enumerate(rows) if r.get("newly_completed") == ["689ecdf417e8"])
    rows[index]["newly_completed"] = []
    rows[index - 1]["newly_completed"] = ["689ecdf417e8"]
    trace = write(tmp_path / "t.jsonl", rows)
    result = tally_replay(str(trace))
    assert result.exit_code == 1
    flagged = [line for line in result.output.splitlines() if "DIFFERS (line" in line]
    assert len(flagged) == 2
    assert (
        f"DIFFERS (line {index + 1}): newly_completed is [], the rules complete ['689ecdf417e8']"
        in flagged[1]
    )
    assert f"(line {index}):" in flagged[0]
    assert "2 rows of" in result.output and "differ from what the counting rules complete" in result.output
    doc = json.loads(tally_replay(str(trace), "-o", "json").stdout)
    assert doc["mismatches"] == 2


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"seq": 9, "method": "apply_deltas", "per_task": [["t", "s", 1]', "not a JSON object"),
        ('{"seq": 9, "method": "apply_deltas", "per_task": [["t", "s", "1"]]}', "per_task[0] must be"),
        ('{"seq": 9, "method": "apply_deltaz", "per_task": []}', "'method' must be one of"),
        ('["apply_deltas"]', "a row must be a JSON object"),
        ('{"method": "are_completed", "source_ids": ["a", "b"], "result": [true]}', "'result' has 1 entries"),
        ('{"method": "batch", "deltas": -1, "counts": {}}', "'deltas' must be a count"),
    ],
)
def test_a_corrupted_line_is_a_clear_error_with_its_line_number(tmp_path: Path, line: str, why: str) -> None:
    text = NEMO_TRACE.read_text().splitlines()
    text[6] = line  # line 7
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(text) + "\n")
    result = tally_replay(str(trace))
    assert result.exit_code == 2
    assert f"{trace}, line 7: " in result.output
    assert why in result.output
    with pytest.raises(TraceError) as caught:
        read_trace(trace)
    assert caught.value.line == 7


def test_a_last_line_cut_short_says_so(tmp_path: Path) -> None:
    text = NEMO_TRACE.read_text()
    trace = tmp_path / "t.jsonl"
    trace.write_text(text[: text.rindex('"completed"')])
    result = tally_replay(str(trace))
    assert result.exit_code == 2
    assert "line 37: not a JSON object" in result.output and "cut short" in result.output


def test_a_missing_trace_is_one_line(tmp_path: Path) -> None:
    result = tally_replay(str(tmp_path / "nope.jsonl"))
    assert result.exit_code == 2
    assert "cannot read the trace" in result.output and "nope.jsonl" in result.output


def tally_rows(writer: str, settle_ms: int, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    opened = {
        "writer": writer,
        "method": "open",
        "checkpoint": "cp",
        "writer_id": writer,
        "settle_ms": settle_ms,
    }
    return [opened, *({"writer": writer, **row} for row in rest)]


def batch(n: int, completed: int, refused: int = 0) -> dict[str, Any]:
    return {"method": "batch", "deltas": n, "counts": {"completed": completed}, "refused": refused}


def test_a_tally_trace_is_replayed_batch_by_batch_and_checked_against_the_coordinators_counts(
    tmp_path: Path,
) -> None:
    rows = tally_rows(
        "w1",
        0,
        {"method": "apply_deltas", "per_task": [["a", "a", 1], ["b", "b", 1]]},
        {"method": "apply_deltas", "per_task": [["a1", "a", -1]]},
        # One batch across both calls; then b reaches zero and goes up again within one batch: Tally
        # completes only what is still zero at the end of the batch.
        batch(3, 1),
        {"method": "apply_deltas", "per_task": [["b1", "b", -1]]},
        {"method": "apply_deltas", "per_task": [["b2", "b", 1]]},
        batch(2, 0),
        {"method": "apply_deltas", "per_task": [["c", "c", 1]]},
        {"method": "close", "counts": {"completed": 1}, "incomplete_count": 1},
    )
    [run] = replay(read_trace(write(tmp_path / "t.jsonl", rows)))
    assert run.mode == "batch" and run.settle_ms == 0
    assert [(s.method, s.completed) for s in run.steps if s.method == "batch"] == [
        ("batch", ["a"]),
        ("batch", []),
    ]
    assert run.mismatches == []
    assert run.undelivered == 1
    assert run.pending == {"b": 1}
    # Call by call (NeMo Curator's actor), b would have completed on its own call.
    calls = [{k: v for k, v in r.items() if k != "writer"} for r in rows if r["method"] != "batch"]
    calls[0] = {"method": "wait", "result": 0}
    calls[-1] = {"method": "close"}
    [anchor] = replay(read_trace(write(tmp_path / "calls.jsonl", calls)))
    assert anchor.completed == ["a", "b"]
    assert [a.source_id for s in anchor.steps for a in s.anomalies] == ["b"]

    rows[3] = {"writer": "w1", **batch(3, 2)}  # the coordinator said 2: flagged
    result = tally_replay(str(write(tmp_path / "bad.jsonl", rows)))
    assert result.exit_code == 1
    assert "DIFFERS (line 4): the coordinator completed 2 sources, the rules complete 1" in result.output


def test_batch_rows_recorded_out_of_order_are_replayed_in_batch_seq_order(tmp_path: Path) -> None:
    """Two batches on the wire, the second's answer recorded first (as SDKs before the fix did):
    replay applies them in the order the coordinator did, and says so."""
    rows = tally_rows(
        "w1",
        0,
        {"method": "apply_deltas", "per_task": [["a", "a", 1], ["a1", "a", -1]]},  # batch 1: a done
        {"method": "apply_deltas", "per_task": [["b", "b", 1], ["c", "c", 1]]},  # batch 2: nothing
        {**batch(2, 0), "batch_seq": 2},
        {**batch(2, 1), "batch_seq": 1},
        {"method": "apply_deltas", "per_task": [["b1", "b", -1]]},
        {**batch(1, 1), "batch_seq": 3},
        {"method": "close", "counts": {"completed": 2}, "incomplete_count": 1},
    )
    [run] = replay(read_trace(write(tmp_path / "t.jsonl", rows)))
    assert run.mismatches == [] and run.completed == ["a", "b"]
    steps = [s for s in run.steps if s.method == "batch"]
    assert [(s.line, s.completed) for s in steps] == [(5, ["a"]), (4, []), (7, ["b"])]
    assert ["batch_seq order" in (s.note or "") for s in steps] == [True, True, False]


def test_with_a_settle_window_batches_are_not_compared_but_totals_at_close_are(tmp_path: Path) -> None:
    rows = tally_rows(
        "w1",
        250,
        {"method": "apply_deltas", "per_task": [["a", "a", 1], ["a1", "a", -1]]},
        batch(2, 0),
        {"method": "close", "counts": {"completed": 1}, "incomplete_count": 0},
    )
    [run] = replay(read_trace(write(tmp_path / "t.jsonl", rows)))
    assert run.mismatches == []
    assert "settle window" in (run.steps[2].note or "")
    rows[-1]["counts"] = {"completed": 0}
    [run] = replay(read_trace(write(tmp_path / "t.jsonl", rows)))
    assert [s.line for s in run.mismatches] == [4]


def test_rows_of_several_writers_in_one_file_are_separate_runs(tmp_path: Path) -> None:
    one = tally_rows("w1", 0, {"method": "apply_deltas", "per_task": [["a", "a", 0]]}, batch(1, 1))
    two = tally_rows("w2", 0, {"method": "apply_deltas", "per_task": [["a", "a", 1]]}, batch(1, 0))
    again = tally_rows("w1", 0, {"method": "apply_deltas", "per_task": [["b", "b", 0]]}, batch(1, 1))
    mixed = [one[0], two[0], one[1], two[1], two[2], one[2], *again]
    runs = replay(read_trace(write(tmp_path / "t.jsonl", mixed)))
    assert [(r.writer, r.completed) for r in runs] == [("w1", ["a"]), ("w2", []), ("w1", ["b"])]
    assert all(not r.mismatches for r in runs)


def test_sources_answered_completed_before_the_first_delta_make_anomalies() -> None:
    rules = Rules(["done"])
    outcome = rules.apply([("t", "done", 1), ("u", "new", 0)])
    assert [a.source_id for a in outcome.anomalies] == ["done"]
    assert outcome.completed == ["new"]
    assert rules.completed() == {"new"}
    assert rules.apply([("t", "done", 1)]).counts["applied"] == 1  # un-completed: counted again


def test_deltas_buffered_before_open_and_a_rerun_under_the_same_id_split_into_runs(tmp_path: Path) -> None:
    early = {"writer": "w1", "method": "apply_deltas", "per_task": [["a", "a", 1]]}
    first = tally_rows("w1", 0, batch(1, 0), {"method": "close", "counts": {"completed": 0}})
    rerun = [
        {"writer": "w1", "method": "apply_deltas", "per_task": [["a1", "a", -1]]},
        *tally_rows("w1", 0, batch(1, 0)),
    ]
    runs = replay(read_trace(write(tmp_path / "t.jsonl", [early, *first, *rerun])))
    assert [(r.mode, r.pending, len(r.steps)) for r in runs] == [
        ("batch", {"a": 1}, 4),
        ("batch", {"a": -1}, 3),
    ]
    assert all(not r.mismatches for r in runs)
