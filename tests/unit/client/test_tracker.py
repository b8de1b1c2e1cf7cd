"""The generic tracker's delta arithmetic, checked against a reference model of DESIGN §2."""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tally
from tally.integrations.tracker import Report, Task, Tracker, root_task_id
from tests.unit.client.tally_fakes import FakeTransport, make_client

Delta = tuple[str, str, int]


class Ledger:
    """One writer under DESIGN §2 with settle_ms=0: dedup, rewrite, anomaly, complete at zero."""

    def __init__(self, completed: Iterable[str] = ()) -> None:
        self.completed = set(completed)
        self.pending: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.log: list[Delta] = []
        self.skipped = self.rewritten = self.anomalies = 0

    def apply_deltas(self, deltas: Iterable[Delta]) -> None:
        for task_id, sid, d in deltas:
            self.log.append((task_id, sid, d))
            old = self.seen.get(task_id)
            if old == d:
                self.skipped += 1
                continue
            if sid in self.completed:
                self.anomalies += 1
                self.completed.discard(sid)
                continue
            self.rewritten += old is not None
            self.seen[task_id] = d
            self.pending[sid] = self.pending.get(sid, 0) + d - (old or 0)
            if self.pending[sid] == 0:
                del self.pending[sid]
                self.completed.add(sid)

    def are_completed(self, ids: Iterable[str]) -> list[bool]:
        return [i in self.completed for i in ids]


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def tracker(ledger: Ledger) -> Tracker:
    return Tracker(ledger)


def test_start_is_plus_one_keyed_on_the_root_task(tracker: Tracker, ledger: Ledger) -> None:
    task = tracker.start("a")
    assert task == Task("1:a", "a") and task.id == root_task_id("a")
    assert ledger.log == [("1:a", "a", 1)] and ledger.pending == {"a": 1}


def test_split_is_one_delta_n_minus_1_keyed_on_the_first_child(tracker: Tracker, ledger: Ledger) -> None:
    children = tracker.start("a").split(3)
    assert [c.id for c in children] == ["1:a_0", "1:a_1", "1:a_2"]
    assert ledger.log[1:] == [("1:a_0", "a", 2)] and ledger.pending == {"a": 3}


def test_each_outcome_delta(tracker: Tracker, ledger: Ledger) -> None:
    root = tracker.start("s")
    mid = root.then()
    assert mid.id == "1:s_0" and ledger.log[-1] == ("1:s_0", "s", 0)
    a, b, c, d = mid.split(4)
    assert ledger.log[-1] == ("1:s_0_0", "s", 3)
    a.done()
    assert ledger.log[-1] == ("1:s_0_0_0", "s", -1)
    b.drop()
    assert ledger.log[-1] == ("1:s_0_1_0", "s", -1)
    c.failed()
    assert ledger.log[-1] == ("1:s_0_2_0", "s", 0)
    d.split(0)  # split(0) is done()
    assert ledger.log[-1] == ("1:s_0_3_0", "s", -1)
    assert ledger.pending == {"s": 1} and tracker.open_tasks == 1  # only the failed task
    c.done()  # a retry succeeds: the same key is rewritten from 0 to -1
    assert ledger.log[-1] == ("1:s_0_2_0", "s", -1) and ledger.rewritten == 1
    assert ledger.completed == {"s"} and tracker.open_tasks == 0


def test_failed_leaves_the_source_open_and_it_replays(tracker: Tracker, ledger: Ledger) -> None:
    left, right = tracker.start("s").split(2)
    left.done()
    right.failed()
    assert ledger.completed == set() and ledger.pending == {"s": 1}
    # The next run is a new writer: fresh pending state, same checkpoint.
    rerun = Ledger(ledger.completed)
    again = Tracker(rerun)
    assert again.todo(["s"]) == ["s"]
    for part in again.start("s").split(2):
        part.done()
    assert rerun.completed == {"s"} and rerun.anomalies == 0


def test_a_second_outcome_is_refused(tracker: Tracker, ledger: Ledger) -> None:
    task = tracker.start("s")
    task.done()
    sent = list(ledger.log)
    for again in (task.done, task.drop, task.then, task.failed, lambda: task.split(2)):
        with pytest.raises(ValueError, match="not open here"):
            again()
    assert ledger.log == sent


def test_bad_arguments(tracker: Tracker) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        tracker.start("")
    with pytest.raises(ValueError, match="non-empty strings"):
        tracker.todo(["a", ""])
    task = tracker.start("s")
    for n in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n >= 0"):
            task.split(n)  # type: ignore[arg-type]
    task.done()


def test_a_retried_tree_sends_the_same_deltas_and_is_skipped(ledger: Ledger) -> None:
    def run(t: Tracker) -> None:
        for part in t.start("s").split(3):
            part.then().done()

    run(Tracker(ledger))
    first = list(ledger.log)
    assert ledger.completed == {"s"}
    run(Tracker(ledger))  # a retry within the same writer
    assert ledger.log[len(first) :] == first and ledger.skipped == len(first) and ledger.anomalies == 0


def test_task_ids_of_different_sources_never_collide(tracker: Tracker, ledger: Ledger) -> None:
    for source in ("a", "a_0", "1:a", "1:a_0", "2:a_0"):
        for part in tracker.start(source).split(2):
            part.done()
    assert ledger.skipped == ledger.anomalies == 0
    assert ledger.completed == {"a", "a_0", "1:a", "1:a_0", "2:a_0"}


def test_todo_skips_completed_keeps_order_and_drops_duplicates(tracker: Tracker, ledger: Ledger) -> None:
    ledger.completed = {"b"}
    assert tracker.todo(["c", "b", "a", "c"]) == ["c", "a"]


def test_todo_declares_the_sources_through_a_real_writer(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTransport()
    fake.completed = {"b"}
    with make_client(fake) as client, client.writer("cp") as writer:
        tracker = Tracker(writer)
        assert tracker.todo(["a", "b", "c", "a"]) == ["a", "c"]
        assert fake.args["declare_sources"] == [("cp", ("a", "b", "c"), 0)]
        fake.fail("declare_sources", tally.Internal("an older coordinator"))
        with caplog.at_level("WARNING"):
            assert Tracker(writer).todo(["d"]) == ["d"]
        assert "could not declare 1 source (" in caplog.text
    # A stand-in writer without declare (the Ledger here) declares nothing: see the test above.


def test_tasks_pickle_as_their_ids_and_a_worker_reports_through_a_report(
    tracker: Tracker, ledger: Ledger
) -> None:
    root = tracker.start("s")
    shipped = pickle.loads(pickle.dumps(root))
    assert shipped == root and shipped._book is None
    with pytest.raises(RuntimeError, match="Report"):
        shipped.done()

    report = Report()
    task = report.adopt(shipped)
    kept, filtered = task.split(2)
    kept.then().done()
    filtered.drop()
    assert report.deltas == [
        ("1:s_0", "s", 1),
        ("1:s_0_0", "s", 0),
        ("1:s_0_0_0", "s", -1),
        ("1:s_1_0", "s", -1),
    ]
    assert ledger.log == [("1:s", "s", 1)]  # nothing sent until the parent applies it

    returned = pickle.loads(pickle.dumps(report))
    assert len(returned) == 4 and returned.deltas == report.deltas
    tracker.apply(returned)
    assert ledger.log[1:] == report.deltas and ledger.completed == {"s"}
    with pytest.raises(ValueError, match="not open here"):
        tracker.apply(returned)  # applied twice


def test_a_report_applied_before_its_parents_is_refused(tracker: Tracker, ledger: Ledger) -> None:
    root = tracker.start("s")
    parent = Report()
    children = parent.adopt(root).split(2)
    child = Report()
    child.adopt(pickle.loads(pickle.dumps(children[0]))).done()
    with pytest.raises(ValueError, match="not open here"):
        tracker.apply(child)
    assert ledger.pending == {"s": 1}  # the early -1 was not sent: no false completion
    with pytest.raises(ValueError, match="apply the report that created it"):
        tracker.adopt(children[1])
    tracker.apply([parent, child])  # in causal order, as one batch
    tracker.adopt(children[1]).drop()
    assert ledger.completed == {"s"} and tracker.open_tasks == 0


def test_a_bad_record_stops_the_batch_after_the_good_prefix(tracker: Tracker, ledger: Ledger) -> None:
    first, second = tracker.start("a"), tracker.start("b")
    ok, late = Report(), Report()
    ok.adopt(first).done()
    late.adopt(Task("1:b_9", "b")).done()  # never created
    with pytest.raises(ValueError):
        tracker.apply([ok, late])
    assert ledger.completed == {"a"} and ledger.pending == {"b": 1}
    second.done()


OPS = ("split", "then", "done", "drop", "failed")


def outcome(task: Task, op: str, n: int) -> list[Task]:
    if op == "split":
        return task.split(n)
    if op == "then":
        return [task.then()]
    getattr(task, op)()
    return []


@settings(max_examples=300, deadline=None)
@given(data=st.data(), sources=st.lists(st.sampled_from(["a", "a_0", "1:a", "b"]), min_size=1, unique=True))
def test_any_tree_completes_exactly_when_no_task_failed(data: st.DataObject, sources: list[str]) -> None:
    """Random trees of split/then/done/drop/failed over interleaved sources, each outcome given
    either in the parent or by a "worker" (a pickled task adopted by a Report, applied back).
    At every step a source is completed exactly when all its tasks ended and none failed; a rerun
    of the same outcomes in the same writer is all skips; a new writer replays failed sources."""
    ledger = Ledger()
    tracker = Tracker(ledger)
    todo: list[Task] = [tracker.start(s) for s in sources]
    failed: set[str] = set()
    script: list[tuple[str, str, int]] = []  # (task id, outcome, n), to replay
    created = len(todo)
    while todo:
        task = todo.pop(data.draw(st.integers(0, len(todo) - 1)))
        op = data.draw(st.sampled_from(OPS if created < 40 else ("done", "drop", "failed")))
        n = data.draw(st.integers(0, 3)) if op == "split" else 0
        script.append((task.id, op, n))
        in_worker = data.draw(st.booleans())
        if in_worker:
            report = Report()
            target = report.adopt(pickle.loads(pickle.dumps(task)))
        else:
            target = task
        children = outcome(target, op, n)
        if in_worker:
            tracker.apply(pickle.loads(pickle.dumps(report)))
            children = [tracker.adopt(pickle.loads(pickle.dumps(c))) for c in children]
        if op == "failed":
            failed.add(task.source_id)
        todo.extend(children)
        created += len(children)
        for s in sources:
            still_open = any(t.source_id == s for t in todo)
            assert (s in ledger.completed) == (not still_open and s not in failed), (s, script)
    assert ledger.completed == set(sources) - failed
    assert ledger.anomalies == 0
    assert tracker.open_tasks == sum(1 for _, op, _ in script if op == "failed")

    # The same outcomes again in the same writer (a retried run): every delta is a duplicate.
    sent = len(ledger.log)
    replay = Tracker(ledger)
    tasks = {t.id: t for t in (replay.start(s) for s in sources)}
    for task_id, op, n in script:
        t = tasks.pop(task_id)
        made = outcome(t, op, n)
        tasks.update((c.id, c) for c in made)
    assert ledger.skipped == len(ledger.log) - sent and ledger.completed == set(sources) - failed

    # A new run (new writer) skips what completed and, with nothing failing, completes the rest.
    rerun = Ledger(ledger.completed)
    again = Tracker(rerun)
    todo_again = again.todo(sources)
    assert todo_again == [s for s in sources if s in failed]
    for s in todo_again:
        for part in again.start(s).split(2):
            part.done()
    assert rerun.completed == set(sources) and rerun.anomalies == 0


class ClaimingLedger(Ledger):
    """A writer with claims: ``others`` hold some sources; some are failed; the rest are free."""

    def __init__(self, others: dict[str, str], failed: Iterable[str] = ()) -> None:
        super().__init__()
        self.others = others
        self.failed = set(failed)
        self.asked: list[list[str]] = []

    def acquire(self, ids: Iterable[str]) -> dict[str, tally.Claim]:
        ids = list(ids)
        self.asked.append(ids)
        claims = {}
        for sid in ids:
            if sid in self.completed:
                claims[sid] = tally.Claim(sid, "completed")
            elif sid in self.failed:
                claims[sid] = tally.Claim(sid, "failed")
            elif sid in self.others:
                claims[sid] = tally.Claim(sid, "held", holder=self.others[sid], until=1.0)
            else:
                claims[sid] = tally.Claim(sid, "acquired", token=1)
        return claims


def test_claim_yields_what_this_run_acquires_as_it_goes_and_asks_again_about_held_ones() -> None:
    ledger = ClaimingLedger({"b": "other", "d": "other"}, failed={"e"})
    ledger.completed.add("c")
    tracker = Tracker(ledger)
    it = tracker.claim(["a", "b", "c", "a", "d", "e", "f"])
    assert ledger.asked == []  # nothing is claimed before the iteration reaches it
    assert next(it) == "a" and ledger.asked == [["a"]]
    assert next(it) == "f"  # "b" and "d" held by another run, "c" completed, "e" failed
    del ledger.others["d"]  # its run ended without completing it
    assert list(it) == ["d"]  # asked once more at the end: "b" is still held, "d" came free
    assert ledger.asked == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["b"], ["d"]]


def test_claim_ahead_asks_in_groups_and_refuses_bad_arguments(tracker: Tracker) -> None:
    ledger = ClaimingLedger({})
    assert list(Tracker(ledger).claim(["a", "b", "c"], ahead=2)) == ["a", "b", "c"]
    assert ledger.asked == [["a", "b"], ["c"]]
    with pytest.raises(TypeError, match="claims need a tally.Writer"):
        tracker.claim(["a"])  # the plain Ledger has no acquire()
    with pytest.raises(ValueError, match="ahead must be an integer >= 1"):
        Tracker(ledger).claim(["a"], ahead=0)
    with pytest.raises(ValueError, match="non-empty strings"):
        Tracker(ledger).claim(["a", ""])
