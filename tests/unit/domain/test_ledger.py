"""The per-writer counting rules of DESIGN §2, one rule per test.

The ledger is driven the way the service drives it: ``apply`` a batch, then (settle window 0)
``mark_completing(result.complete_now)`` and persist what it returns; with a settle window the
caller polls ``mark_completing(due(now))``; on close ``mark_completing(take_all_settling())``.
On an anomaly the service also un-completes the source in the checkpoint's ``CompletedSet``
(§2.3); ``run`` below does that too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pytest

from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.ledger import Anomaly, ApplyCounts, BatchResult, Delta, WriterLedger

# The rules on each counting core: compiled (tally_server._ledgercore) and pure Python.
pytestmark = pytest.mark.usefixtures("each_ledger_core")


def open_writer(settle_s: float = 0.0, before: Iterable[str] = ()) -> tuple[WriterLedger, CompletedSet]:
    completed = CompletedSet(before)
    return WriterLedger(completed.as_of_now(), settle_s=settle_s), completed


def run(
    ledger: WriterLedger, completed: CompletedSet, batch: list[Delta], now: float = 0.0
) -> tuple[BatchResult, list[str]]:
    """One ApplyDeltas call with settle window 0, as the service makes it."""
    result = ledger.apply(batch, now)
    for anomaly in result.anomalies:
        completed.discard(anomaly.source_id)
    done = ledger.mark_completing(result.complete_now)
    completed.add(done)
    return result, done


def counted(result: BatchResult) -> ApplyCounts:
    """The per-call counts apply() decides. Its ``completed`` is left to the caller (only
    mark_completing knows what completes), so it is not pinned here."""
    return replace(result.counts, completed=0)


# --- rules 1-5 -------------------------------------------------------------------------------


def test_new_task_applies_its_delta() -> None:
    ledger, completed = open_writer()
    result, done = run(ledger, completed, [("0_s", "s", 1), ("0_t", "t", 3)])
    assert counted(result) == ApplyCounts(applied=2)
    assert result.anomalies == []
    assert done == []
    assert ledger.pending == {"s": 1, "t": 3}
    assert ledger.applied == {"0_s": 1, "0_t": 3}


def test_same_task_same_delta_is_skipped() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("0_s", "s", 2)])
    result, _ = run(ledger, completed, [("0_s", "s", 2), ("0_s", "s", 2)])
    assert counted(result) == ApplyCounts(skipped=2)
    assert ledger.pending == {"s": 2}


def test_same_task_different_delta_rewrites_pending() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 2), ("b", "s", 1)])
    result, _ = run(ledger, completed, [("a", "s", 5)])
    # pending += d - old: 3 + 5 - 2
    assert counted(result) == ApplyCounts(rewritten=1)
    assert ledger.pending == {"s": 6}
    assert ledger.applied["a"] == 5
    # The newest delta is what later retries are compared against.
    result, _ = run(ledger, completed, [("a", "s", 5), ("a", "s", 2)])
    assert counted(result) == ApplyCounts(skipped=1, rewritten=1)
    assert ledger.pending == {"s": 3}


def test_rewrite_that_reaches_zero_completes() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1), ("b", "s", 1)])
    result, done = run(ledger, completed, [("b", "s", -1)])
    assert counted(result) == ApplyCounts(rewritten=1)
    assert done == ["s"]
    assert ledger.pending == {}


def test_source_completes_at_zero_and_its_pending_entry_is_removed() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1), ("b", "t", 1)])
    result = ledger.apply([("c", "s", -1)], 0.0)
    assert result.complete_now == ["s"]
    # Zero but not yet completing: the caller decides.
    assert ledger.pending == {"s": 0, "t": 1}
    assert not ledger.is_completed("s")

    assert ledger.mark_completing(result.complete_now) == ["s"]
    assert ledger.pending == {"t": 1}
    assert ledger.own_completed == {"s"}
    assert ledger.is_completed("s")
    # Handing the same source in twice completes it once.
    assert ledger.mark_completing(["s"]) == []
    assert ledger.totals.completed == 1


def test_mark_completing_refuses_sources_not_at_zero() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1)])
    assert ledger.mark_completing(["s", "never-seen"]) == []
    assert ledger.pending == {"s": 1}
    assert ledger.own_completed == set()


# --- anomalies (§2, §2.3) --------------------------------------------------------------------


def test_anomaly_seen_task_with_new_delta_for_completed_source() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1), ("b", "s", -1)])
    assert "s" in completed

    result, done = run(ledger, completed, [("b", "s", -2)])
    assert result.anomalies == [Anomaly(task_id="b", source_id="s", old_delta=-1, new_delta=-2)]
    assert counted(result) == ApplyCounts(anomalies=1)
    assert done == []
    # Un-completed, and the delta is dropped: not remembered, not counted.
    assert not ledger.is_completed("s")
    assert ledger.own_completed == set()
    assert ledger.applied["b"] == -1
    assert ledger.pending == {}
    assert "s" not in completed
    # From now on the source counts again, as in the anchor.
    result, _ = run(ledger, completed, [("c", "s", 1)])
    assert counted(result) == ApplyCounts(applied=1)
    assert ledger.pending == {"s": 1}


def test_anomaly_new_task_for_completed_source() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1), ("b", "s", -1)])

    result, done = run(ledger, completed, [("c", "s", 1)])
    assert result.anomalies == [Anomaly(task_id="c", source_id="s", old_delta=None, new_delta=1)]
    assert counted(result) == ApplyCounts(anomalies=1)
    assert done == []
    assert "c" not in ledger.applied
    assert ledger.pending == {}
    assert ledger.own_completed == set()
    assert "s" not in completed


def test_source_completed_before_open_is_an_anomaly() -> None:
    ledger, completed = open_writer(before=["old"])
    assert ledger.is_completed("old")

    result, _ = run(ledger, completed, [("x", "old", 1)])
    assert result.anomalies == [Anomaly(task_id="x", source_id="old", old_delta=None, new_delta=1)]
    assert counted(result) == ApplyCounts(anomalies=1)
    assert ledger.pending == {}
    assert "old" not in completed
    # Once un-completed in the checkpoint's set, the next batch counts it normally.
    result, _ = run(ledger, completed, [("y", "old", 1)])
    assert counted(result) == ApplyCounts(applied=1)
    assert ledger.pending == {"old": 1}


def test_source_completed_before_open_counts_again_later_in_the_same_batch() -> None:
    ledger, completed = open_writer(before=["old"])
    result, _ = run(ledger, completed, [("x", "old", 1), ("y", "old", 1)])
    # Anchor: first delta is the anomaly, second is applied.
    assert counted(result) == ApplyCounts(applied=1, anomalies=1)
    assert ledger.pending == {"old": 1}


def test_sources_completed_by_other_writers_after_open_are_not_anomalies() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("a", "s", 1)])
    # Another writer completes "s" and "u" after this one opened.
    completed.add(["s", "u"])
    assert "s" in completed
    assert not ledger.is_completed("s")
    assert completed.as_of_now()("s")  # a writer opening now would see it

    result, done = run(ledger, completed, [("b", "s", -1), ("c", "u", 1)])
    assert result.anomalies == []
    assert counted(result) == ApplyCounts(applied=2)
    # This writer keeps counting and completes "s" again into its own file.
    assert done == ["s"]
    assert ledger.own_completed == {"s"}
    assert ledger.pending == {"u": 1}
    assert sorted(completed.sources()) == ["s", "u"]


# --- what the stage adapter sends ------------------------------------------------------------


def test_negative_interim_counts_are_legal() -> None:
    ledger, completed = open_writer()
    # A child's sink -1 overtakes its parent's +1.
    result, done = run(ledger, completed, [("0_s_0", "s", -1)])
    assert counted(result) == ApplyCounts(applied=1)
    assert result.anomalies == []
    assert done == []
    assert ledger.pending == {"s": -1}

    _, done = run(ledger, completed, [("0_s", "s", 1)])
    assert done == ["s"]
    assert ledger.pending == {}


def test_failed_task_zero_keeps_source_open() -> None:
    ledger, completed = open_writer()
    run(ledger, completed, [("0_s", "s", 1)])
    result, done = run(ledger, completed, [("0_s_0", "s", 0)])
    assert counted(result) == ApplyCounts(applied=1)
    assert done == []
    assert ledger.pending == {"s": 1}
    assert not ledger.is_completed("s")


def test_zero_for_an_unseen_source_completes_it_like_the_anchor() -> None:
    # The anchor's rule 5 fires on a first delta of 0 (count 0 + 0). With settle window 0
    # Tally does the same; the settle window is what protects against it (next test).
    ledger, completed = open_writer()
    _, done = run(ledger, completed, [("0_s_0", "s", 0)])
    assert done == ["s"]


def test_settle_window_absorbs_a_zero_that_overtakes_its_source_delta() -> None:
    ledger, _ = open_writer(settle_s=1.0)
    assert ledger.apply([("0_s_0", "s", 0)], 0.0).complete_now == []
    assert ledger.settling == {"s": 1.0}
    ledger.apply([("0_s", "s", 1)], 0.5)
    assert ledger.settling == {}
    assert ledger.due(5.0) == []
    assert ledger.pending == {"s": 1}


def test_settling_stays_in_deadline_order_when_lease_time_steps_back() -> None:
    ledger, _ = open_writer(settle_s=1.0)
    for t, sid in enumerate("abc"):
        ledger.apply([(f"0_{sid}", sid, 0)], float(t))  # a at 1.0, b at 2.0, c at 3.0
    # A failed commit settles "a" again, due at once; lease time stepping back (a saturated loop)
    # would make "d" due before "c": both wait for the latest deadline instead (a window is a
    # minimum), so settling stays in order and due() stops at the first open window.
    assert ledger.mark_completing(ledger.due(1.0)) == ["a"]
    ledger.revert_completing(["a"], 1.5)
    ledger.apply([("0_d", "d", 0)], 0.2)
    assert ledger.settling == {"b": 2.0, "c": 3.0, "a": 3.0, "d": 3.0}
    assert ledger.due(2.9) == ["b"]
    # A delta for a settling source cancels its window; at zero again it settles anew, last.
    ledger.apply([("0_c_0", "c", 1), ("0_c_1", "c", -1)], 2.95)
    assert list(ledger.settling.items()) == [("a", 3.0), ("d", 3.0), ("c", 3.95)]
    assert ledger.due(3.0) == ["a", "d"]
    assert ledger.due(10.0) == ["c"] and ledger.settling == {}


@pytest.mark.parametrize(
    ("continuing", "failed", "fanout_delta", "left_after_sinks"),
    [
        (3, 0, 2, 0),  # 1 -> 3, all reach the sink: completes
        (2, 1, 2, 1),  # 1 -> 3, one child failed: the source stays open
        (0, 0, -1, 0),  # 1 -> N at the sink itself: the one delta closes the source
    ],
)
def test_fan_out_sends_continuing_plus_failed_minus_one(
    continuing: int, failed: int, fanout_delta: int, left_after_sinks: int
) -> None:
    assert continuing + failed - 1 == fanout_delta
    ledger, completed = open_writer()
    run(ledger, completed, [("0_s", "s", 1)])
    # One delta, keyed on the first child's id.
    result, done = run(ledger, completed, [("0_s_0", "s", fanout_delta)])
    assert counted(result) == ApplyCounts(applied=1)
    if continuing == 0:
        assert done == ["s"]
        return
    assert done == []
    assert ledger.pending == {"s": 1 + fanout_delta}
    for child in range(continuing):
        _, done = run(ledger, completed, [(f"0_s_0_{child}", "s", -1)])
    if left_after_sinks == 0:
        assert done == ["s"]
        assert ledger.pending == {}
    else:
        assert done == []
        assert ledger.pending == {"s": left_after_sinks}


# --- settle window (§2.2) --------------------------------------------------------------------


def test_settle_zero_then_more_deltas_within_window_cancels() -> None:
    ledger, _ = open_writer(settle_s=1.0)
    ledger.apply([("a", "s", 1)], 0.0)
    result = ledger.apply([("b", "s", -1)], 0.25)
    assert result.complete_now == []
    assert ledger.settling == {"s": 1.25}

    ledger.apply([("c", "s", 1)], 0.5)  # the fan-out that the sink overtook
    assert ledger.settling == {}
    assert ledger.due(10.0) == []
    assert ledger.pending == {"s": 1}
    assert ledger.own_completed == set()

    ledger.apply([("d", "s", -1)], 0.75)
    assert ledger.settling == {"s": 1.75}
    assert ledger.due(1.5) == []
    assert ledger.mark_completing(ledger.due(1.75)) == ["s"]
    assert ledger.own_completed == {"s"}
    assert ledger.pending == {}


def test_due_returns_sources_only_once_their_deadline_passed() -> None:
    ledger, _ = open_writer(settle_s=0.25)
    ledger.apply([("a", "s", 1), ("b", "t", 1)], 10.0)
    ledger.apply([("c", "s", -1)], 10.0)
    ledger.apply([("d", "t", -1)], 10.5)
    assert ledger.settling == {"s": 10.25, "t": 10.75}

    assert ledger.due(10.0) == []
    assert ledger.due(10.25) == ["s"]  # deadline inclusive
    assert ledger.due(10.25) == []  # taken
    assert ledger.settling == {"t": 10.75}
    assert ledger.mark_completing(["s"]) == ["s"]
    assert ledger.mark_completing(ledger.due(11.0)) == ["t"]
    assert ledger.pending == {}
    assert ledger.totals.completed == 2


def test_take_all_settling_finalizes_every_settling_source_on_close() -> None:
    ledger, _ = open_writer(settle_s=60.0)
    ledger.apply([("a", "s", 1), ("b", "t", 1), ("c", "u", 1)], 0.0)
    ledger.apply([("d", "s", -1), ("e", "t", -1)], 1.0)
    assert ledger.due(2.0) == []

    assert ledger.mark_completing(ledger.take_all_settling()) == ["s", "t"]
    assert ledger.settling == {}
    assert ledger.own_completed == {"s", "t"}
    assert ledger.pending == {"u": 1}  # left incomplete, replays next run
    assert ledger.take_all_settling() == []


def test_duplicate_for_settling_source_restarts_window_but_keeps_completion() -> None:
    ledger, _ = open_writer(settle_s=1.0)
    ledger.apply([("a", "s", 1), ("b", "s", -1)], 0.0)
    assert ledger.settling == {"s": 1.0}

    result = ledger.apply([("b", "s", -1)], 0.5)  # a client retry
    assert counted(result) == ApplyCounts(skipped=1)
    assert ledger.settling == {"s": 1.5}
    assert ledger.due(1.0) == []
    assert ledger.pending == {"s": 0}
    assert ledger.mark_completing(ledger.due(1.5)) == ["s"]
    assert ledger.own_completed == {"s"}


def test_settle_window_ends_better_than_settle_zero_when_a_zero_comes_too_early() -> None:
    batches: list[list[Delta]] = [[("a", "s", 1)], [("b", "s", -1)], [("c", "s", 1)], [("d", "s", -1)]]
    # Settle 0 (the anchor): the early zero completes s, c is an anomaly and is dropped, d counts
    # s down to -1, and s replays next run.
    instant, completed = open_writer()
    outcomes = [run(instant, completed, batch) for batch in batches]
    assert [done for _, done in outcomes] == [[], ["s"], [], []]
    assert [len(result.anomalies) for result, _ in outcomes] == [0, 0, 1, 0]
    assert instant.pending == {"s": -1}
    # Within one window the same stream completes s once, correctly.
    settled, _ = open_writer(settle_s=1.0)
    for now, batch in enumerate(batches):
        assert settled.apply(batch, now / 10).anomalies == []
    assert settled.due(1.0) == []
    assert settled.mark_completing(settled.due(2.0)) == ["s"]
    assert settled.pending == {}


def test_settling_source_is_not_completed_for_this_writer() -> None:
    # A new task for a settling source is counted, not an anomaly.
    ledger, _ = open_writer(settle_s=1.0)
    ledger.apply([("a", "s", 1), ("b", "s", -1)], 0.0)
    result = ledger.apply([("c", "s", 2)], 0.5)
    assert result.anomalies == []
    assert counted(result) == ApplyCounts(applied=1)
    assert ledger.pending == {"s": 2}
    assert ledger.settling == {}


# --- a failed persist ------------------------------------------------------------------------


def test_revert_completing_settles_the_source_again_for_a_retry() -> None:
    ledger, _ = open_writer()
    ledger.apply([("a", "s", 1), ("b", "s", -1)], 0.0)
    assert ledger.mark_completing(["s"]) == ["s"]

    ledger.revert_completing(["s"], 5.0)  # the commit failed
    assert ledger.own_completed == set()
    assert not ledger.is_completed("s")
    assert ledger.pending == {"s": 0}
    assert ledger.settling == {"s": 5.0}
    assert ledger.totals.completed == 0
    assert ledger.due(4.0) == []
    assert ledger.mark_completing(ledger.due(5.0)) == ["s"]
    assert ledger.totals.completed == 1


def test_revert_completing_leaves_a_source_un_completed_by_an_anomaly_alone() -> None:
    ledger, _ = open_writer()
    ledger.apply([("a", "s", 1), ("b", "s", -1)], 0.0)
    assert ledger.mark_completing(["s"]) == ["s"]
    # While the commit is in flight a delta shows the source was not done.
    result = ledger.apply([("c", "s", 1)], 1.0)
    assert [a.source_id for a in result.anomalies] == ["s"]

    ledger.revert_completing(["s"], 2.0)
    assert ledger.pending == {}
    assert ledger.settling == {}
    assert ledger.own_completed == set()


# --- the one deliberate difference from the anchor ---------------------------------------------


def test_source_touching_zero_mid_batch_completes_only_if_still_zero_at_end() -> None:
    # The anchor would complete "s" here (its count touched zero after the second delta), lose
    # the count of the third and turn the fourth batch's delta into an anomaly.
    ledger, completed = open_writer()
    result, done = run(ledger, completed, [("a", "s", 1), ("b", "s", -1), ("c", "s", 1)])
    assert result.complete_now == []
    assert done == []
    assert ledger.pending == {"s": 1}

    result, done = run(ledger, completed, [("d", "s", -1)])
    assert result.anomalies == []
    assert done == ["s"]


def test_source_touching_zero_twice_in_a_batch_completes_once() -> None:
    ledger, completed = open_writer()
    result, done = run(ledger, completed, [("a", "s", 1), ("b", "s", -1), ("c", "s", 1), ("d", "s", -1)])
    assert result.complete_now == ["s"]
    assert done == ["s"]
    assert ledger.totals.completed == 1


# --- counts --------------------------------------------------------------------------------------


def test_counts_per_call_and_totals() -> None:
    ledger, completed = open_writer(before=["old"])
    first, _ = run(ledger, completed, [("a", "s", 1), ("b", "s", 1), ("a", "s", 1), ("c", "t", 1)])
    assert counted(first) == ApplyCounts(applied=3, skipped=1)
    second, done = run(ledger, completed, [("b", "s", -1), ("x", "old", 1), ("d", "t", -1)])
    assert counted(second) == ApplyCounts(rewritten=1, anomalies=1, applied=1)
    assert sorted(done) == ["s", "t"]
    third, _ = run(ledger, completed, [("d", "t", -1), ("e", "t", 1)])
    assert counted(third) == ApplyCounts(skipped=1, anomalies=1)

    assert ledger.totals == ApplyCounts(applied=4, skipped=2, rewritten=1, anomalies=2, completed=2)
