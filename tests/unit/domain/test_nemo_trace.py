"""Replay a real NeMo Curator 1.4.0 pipeline's actor calls through the ledger, call by call.

The trace (see the fixture README) is what a JsonlReader -> 1:1 -> 1->N -> filter -> JsonlWriter
pipeline sent to its resumability actor, with what the anchor completed on each call.
"""

from __future__ import annotations

from typing import Any

import pytest

from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.ledger import ApplyCounts, Delta, WriterLedger
from tests.conftest import load_trace

# The rules on each counting core: compiled (tally_server._ledgercore) and pure Python.
pytestmark = pytest.mark.usefixtures("each_ledger_core")


def batch_of(row: dict[str, Any]) -> list[Delta]:
    return [(task_id, sid, d) for task_id, sid, d in row["per_task"]]


@pytest.fixture(scope="module")
def trace() -> list[dict[str, Any]]:
    rows = load_trace()
    methods = [row["method"] for row in rows]
    # Pin the recording's shape so a truncated or swapped fixture cannot pass vacuously.
    assert methods.count("apply_deltas") == 33
    assert methods.count("are_completed") == 1
    assert methods[-1] == "close"
    return rows


def test_replay_completes_exactly_what_the_anchor_completed_call_by_call(trace: list[dict[str, Any]]) -> None:
    completed = CompletedSet()
    ledger = WriterLedger(completed.as_of_now(), settle_s=0.0)
    completions: list[str] = []
    for now, row in enumerate(trace):
        method = row["method"]
        if method == "wait":
            continue
        if method == "are_completed":
            assert [sid in completed for sid in row["source_ids"]] == row["result"], row["seq"]
        elif method == "apply_deltas":
            result = ledger.apply(batch_of(row), float(now))
            assert result.anomalies == [], row["seq"]
            done = ledger.mark_completing(result.complete_now)
            completed.add(done)
            assert sorted(done) == sorted(row["newly_completed"]), row["seq"]
            completions += done
        elif method == "close":
            assert ledger.mark_completing(ledger.take_all_settling()) == []
            assert ledger.pending == row["pending"] == {}
            assert sorted(completed.sources()) == row["completed"]
        else:
            pytest.fail(f"unknown method {method!r} in the trace")

    assert completions == ["eb8f50c7806c", "38f6b8e635d1", "689ecdf417e8", "13c7168e07c4"]
    # 36 distinct task ids, no retries in this recording.
    assert ledger.totals == ApplyCounts(applied=36, completed=4)


def test_replay_with_a_settle_window_completes_the_same_sources_at_close(trace: list[dict[str, Any]]) -> None:
    # The window is longer than the whole recording: nothing completes before close, then all does.
    completed = CompletedSet()
    ledger = WriterLedger(completed.as_of_now(), settle_s=1000.0)
    for now, row in enumerate(trace):
        if row["method"] == "apply_deltas":
            result = ledger.apply(batch_of(row), float(now))
            assert result.complete_now == []
            assert ledger.mark_completing(ledger.due(float(now))) == []
        elif row["method"] == "close":
            assert sorted(ledger.settling) == row["completed"]
            completed.add(ledger.mark_completing(ledger.take_all_settling()))
    assert ledger.pending == {}
    assert sorted(completed.sources()) == ["13c7168e07c4", "38f6b8e635d1", "689ecdf417e8", "eb8f50c7806c"]


def test_rerun_after_the_recorded_run_skips_everything_and_flags_replays(trace: list[dict[str, Any]]) -> None:
    # A second run opening on the completed checkpoint: any delta for a done source is an anomaly.
    first = [row for row in trace if row["method"] == "close"][0]["completed"]
    completed = CompletedSet(first)
    ledger = WriterLedger(completed.as_of_now(), settle_s=0.0)
    batch = batch_of(trace[3])
    assert trace[3]["method"] == "apply_deltas" and len(batch) == 4
    result = ledger.apply(batch, 0.0)
    assert [a.source_id for a in result.anomalies] == [sid for _, sid, _ in batch]
    assert ledger.pending == {}
