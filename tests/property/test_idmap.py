"""The compiled table (tally_server._ledgercore.IdMap) against a dict, operation by operation.

The compiled core must be the pure Python one in everything the ledger can observe: values, the
order of keys (a journal snapshot and a closing writer's list of unfinished sources follow it), the
outcome of ``take_zeros`` and ``apply_new`` (including "None, nothing changed"), and errors.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tally_server.domain import idmap, validation
from tests.conftest import compiled_core_required

# Few keys, so that sets, deletes and re-inserts meet often; ASCII and not, a lone surrogate (a dict
# keeps one), the empty string.
KEYS = ["a", "b", "s0", "s1", "task-0_1", "é", "日本", "\ud800x", "", "k" * 300]
keys = st.sampled_from(KEYS)
# Small counts, and ints at and past int64's ends (the compiled table keeps those as objects).
values = st.integers(-3, 3) | st.sampled_from([2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**70, 2**62])


@pytest.fixture(autouse=True)
def _compiled() -> None:
    compiled_core_required()


def compiled_map(items: dict[str, int] | None = None) -> idmap.IdMap:
    assert idmap.COMPILED is not None
    m = idmap.COMPILED.new_map()
    if items:
        for k, v in items.items():
            m[k] = v
    return m


class Tables(RuleBasedStateMachine):
    """A writer's two tables in the compiled core and the same two as dicts, moved together."""

    def __init__(self) -> None:
        super().__init__()
        self.applied, self.pending = compiled_map(), compiled_map()
        self.model_applied, self.model_pending = idmap.PyIdMap(), idmap.PyIdMap()

    def both(self, name: str) -> tuple[idmap.IdMap, idmap.PyIdMap]:
        return (self.applied, self.model_applied) if name == "applied" else (self.pending, self.model_pending)

    tables = st.sampled_from(["applied", "pending"])

    @rule(table=tables, key=keys, value=values)
    def set(self, table: str, key: str, value: int) -> None:
        m, model = self.both(table)
        m[key] = value
        model[key] = value

    @rule(table=tables, key=keys)
    def delete(self, table: str, key: str) -> None:
        m, model = self.both(table)
        if key in model:
            del m[key]
            del model[key]
        else:
            with pytest.raises(KeyError):
                del m[key]

    @rule(table=tables, key=keys)
    def read(self, table: str, key: str) -> None:
        m, model = self.both(table)
        assert (key in m) == (key in model)
        assert m.get(key) == model.get(key)
        assert m.get(key, 7) == model.get(key, 7)
        if key in model:
            assert m[key] == model[key]
        else:
            with pytest.raises(KeyError):
                m[key]

    @rule(table=tables, sources=st.lists(keys, max_size=5))
    def take_zeros(self, table: str, sources: list[str]) -> None:
        m, model = self.both(table)
        assert m.take_zeros(list(sources)) == model.take_zeros(list(sources))

    @rule(
        batch=st.lists(st.tuples(keys, keys, values), max_size=8),
        done=st.none() | st.sets(keys, max_size=4),
        settling=st.none() | st.sets(keys, max_size=4),
    )
    def apply_new(
        self, batch: list[tuple[str, str, int]], done: set[str] | None, settling: set[str] | None
    ) -> None:
        # ``done``: a writer's own completions, which may be counted only if pending already;
        # ``settling``: sources whose delta, while their count is zero, cancels a settle.
        tasks = [t for t, _, _ in batch]
        sources = [s for _, s, _ in batch]
        deltas = [d for _, _, d in batch]
        assert idmap.COMPILED is not None
        before_applied, before_pending = dict(self.model_applied), dict(self.model_pending)
        window = dict.fromkeys(settling, 1.0) if settling is not None else None
        got = idmap.COMPILED.apply_new(
            self.applied, self.pending, list(tasks), list(sources), list(deltas), done, window
        )
        want = idmap.py_apply_new(
            self.model_applied, self.model_pending, tasks, sources, deltas, done, window
        )
        if done and any(sid in done and sid not in before_pending for sid in sources):
            assert want is None
        if settling and any(before_pending.get(sid) == 0 and sid in settling for sid in sources):
            assert want is None
        if got is None and want is not None:
            # The compiled core also declines a batch whose counts would leave int64 (a dict keeps
            # any int), having changed nothing; the ledger's delta-by-delta path (a dict's
            # operations, as the model's) then applies it.
            assert _beyond_int64(batch, before_pending)
            self.model_applied.clear(), self.model_pending.clear()
            self.model_applied.update(before_applied)
            self.model_pending.update(before_pending)
        else:
            assert got == want

    @rule(table=tables, n=st.integers(1, 300), keep=st.integers(0, 3))
    def grow_and_shrink(self, table: str, n: int, keep: int) -> None:
        """Many keys added, then most deleted: resizes and compactions."""
        m, model = self.both(table)
        added = [f"bulk-{i}" for i in range(n) if f"bulk-{i}" not in model]
        for i, k in enumerate(added):
            m[k] = i
            model[k] = i
        for k in added[keep:]:
            del m[k]
            del model[k]

    @precondition(lambda self: len(self.model_pending) > 0)
    @rule()
    def clear_pending(self) -> None:
        self.pending.clear()
        self.model_pending.clear()

    @invariant()
    def same_as_the_model(self) -> None:
        for m, model in ((self.applied, self.model_applied), (self.pending, self.model_pending)):
            assert len(m) == len(model)
            assert list(m) == list(model)  # the order too
            assert list(m.items()) == list(model.items())
            assert list(m.values()) == list(model.values())
            assert m == dict(model)


def _beyond_int64(batch: list[tuple[str, str, int]], before: dict[str, int]) -> bool:
    """Whether adding the batch's deltas one by one meets a delta or a count outside int64."""
    counts = dict(before)
    for _, sid, d in batch:
        if not -(2**63) <= d < 2**63 or not -(2**63) <= counts.get(sid, 0) < 2**63:
            return True
        counts[sid] = counts.get(sid, 0) + d
        if not -(2**63) <= counts[sid] < 2**63:
            return True
    return False


Tables.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_compiled_tables_are_dicts = Tables.TestCase


def test_a_batch_whose_count_would_overflow_changes_nothing() -> None:
    applied = compiled_map({"t0": 1})
    pending = compiled_map({"old": 2**63 - 2, "other": 5})
    assert idmap.COMPILED is not None
    # The new source and tasks are added first, then "old" would pass int64's end: all undone.
    got = idmap.COMPILED.apply_new(applied, pending, ["t1", "t2", "t3"], ["new", "other", "old"], [1, -5, 2])
    assert got is None
    assert list(applied.items()) == [("t0", 1)]
    assert list(pending.items()) == [("old", 2**63 - 2), ("other", 5)]
    # The same batch without the overflow goes through, in order.
    got = idmap.COMPILED.apply_new(applied, pending, ["t1", "t2", "t3"], ["new", "other", "old"], [1, -5, 1])
    assert got == ["other"]
    assert list(pending.items()) == [("old", 2**63 - 1), ("other", 0), ("new", 1)]


def test_a_task_twice_in_a_batch_declines_it_unchanged() -> None:
    applied, pending = compiled_map({"t0": 1}), compiled_map({"s": 1})
    assert idmap.COMPILED is not None
    assert idmap.COMPILED.apply_new(applied, pending, ["t1", "t2", "t1"], ["s", "s", "s"], [1, 1, 1]) is None
    assert list(applied.items()) == [("t0", 1)] and list(pending.items()) == [("s", 1)]
    # A task already applied: declined too (a skip or a rewrite is the delta-by-delta path's).
    assert idmap.COMPILED.apply_new(applied, pending, ["t9", "t0"], ["s", "s"], [1, 1]) is None
    assert list(applied.items()) == [("t0", 1)] and list(pending.items()) == [("s", 1)]


def test_a_source_done_and_not_pending_declines_the_batch_unchanged() -> None:
    applied, pending = compiled_map({"t0": 1}), compiled_map({"s": 1})
    assert idmap.COMPILED is not None
    # "a" was completed by the writer (it left pending then): counting it again is an anomaly,
    # which only the delta-by-delta path makes. Tasks and counts added before it are undone.
    got = idmap.COMPILED.apply_new(applied, pending, ["t1", "t2", "t3"], ["s", "n", "a"], [-1, 1, 1], {"a"})
    assert got is None
    assert list(applied.items()) == [("t0", 1)] and list(pending.items()) == [("s", 1)]
    # Pending already, a source in the set is counted (it is not the writer's completion).
    got = idmap.COMPILED.apply_new(applied, pending, ["t1", "t2"], ["s", "n"], [-1, 1], {"s", "x"})
    assert got == ["s"] and list(pending.items()) == [("s", 0), ("n", 1)]
    with pytest.raises(TypeError, match="done: set"):
        idmap.COMPILED.apply_new(applied, pending, [], [], [], ["a"])  # type: ignore[arg-type]


def test_a_delta_for_a_settling_source_at_zero_declines_the_batch_unchanged() -> None:
    applied, pending = compiled_map(), compiled_map({"s": 0, "p": 2})
    assert idmap.COMPILED is not None
    settling = {"s": 9.0}
    # "s" settles at zero: its delta would cancel the settle, which only the delta-by-delta path
    # does. What was counted before it is undone.
    got = idmap.COMPILED.apply_new(applied, pending, ["t1", "t2"], ["p", "s"], [-2, 1], None, settling)
    assert got is None and len(applied) == 0 and list(pending.items()) == [("s", 0), ("p", 2)]
    # A source of the dict that is not at zero (and one reaching zero in the batch) is counted.
    got = idmap.COMPILED.apply_new(
        applied, pending, ["t1", "t2", "t3"], ["p", "n", "n"], [-2, 1, -1], None, {"p": 1.0, "n": 1.0}
    )
    assert got == ["p", "n"] and list(pending.items()) == [("s", 0), ("p", 0), ("n", 0)]
    with pytest.raises(TypeError, match="settling: dict"):
        idmap.COMPILED.apply_new(applied, pending, [], [], [], None, ["s"])  # type: ignore[arg-type]


def test_sources_at_zero_come_back_in_the_order_they_first_reached_it() -> None:
    applied, pending = compiled_map(), compiled_map({"b": 1, "a": -1})
    assert idmap.COMPILED is not None
    got = idmap.COMPILED.apply_new(
        applied, pending, ["1", "2", "3", "4", "5"], ["a", "b", "a", "c", "a"], [1, -1, 1, 0, -1]
    )
    # a: 0 (first), 1, 0; b: 0; c: 0 -> in first-zero order, those at zero at the end.
    assert got == ["a", "b", "c"]
    assert got is not None and got[0] == "a"


def test_errors_name_what_is_wrong() -> None:
    m = compiled_map()
    with pytest.raises(TypeError, match="ids are str"):
        m[b"bytes"] = 1  # type: ignore[index]
    with pytest.raises(TypeError, match="values are int"):
        m["k"] = "1"  # type: ignore[assignment]
    assert len(m) == 0 and 3 not in m and m.get(3) is None  # type: ignore[call-overload]
    m["k"] = 1
    with pytest.raises(RuntimeError, match="changed size during iteration"):
        for key in m:
            del m[key]
            m["other"] = 2


def test_a_table_of_task_ids_takes_less_memory_than_a_dict() -> None:
    """The dedup map of 100,000 task ids: the arena against a dict of str (the coordinator's RSS)."""
    ids = [f"0_source-{i:07d}_0_1" for i in range(100_000)]
    m = compiled_map()
    for i, t in enumerate(ids):
        m[t] = 1 if i % 2 else -1
    as_dict = dict.fromkeys(ids, 1)
    dict_bytes = sys.getsizeof(as_dict) + sum(map(sys.getsizeof, ids))
    compiled_bytes = sys.getsizeof(m)
    # Measured: 82 bytes an id (20 of them the id itself) against 107 (getsizeof of the dict and strs).
    assert compiled_bytes / len(ids) < 90, compiled_bytes / len(ids)
    assert compiled_bytes < 0.8 * dict_bytes, (compiled_bytes, dict_bytes)


ids = st.text(alphabet=st.characters(max_codepoint=0x80), max_size=6) | st.sampled_from(
    ["x" * 511, "y" * 512]
)
ints = st.integers(-(2**62) - 1, 2**62 + 1) | st.booleans() | st.sampled_from([2**63, -(2**64)])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(ids, ids, ints), max_size=6))
def test_plain_batch_checks_and_packs_as_validation_does_in_python(rows: list[tuple[str, str, int]]) -> None:
    """The compiled check of a plain batch: same verdict, same bytes for the journal."""
    assert idmap.COMPILED is not None and idmap.COMPILED.plain_batch is not None
    tasks, sources, values = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    want = validation._packed_plain_batch(tasks, sources, values, validation.Limits(), int64=False)
    assert idmap.COMPILED.plain_batch(tasks, sources, values, validation.Limits().max_id_bytes) == want


def test_an_iterator_over_a_cleared_or_refilled_table_stops_with_an_error() -> None:
    m = compiled_map({"a": 1})
    it = iter(m)
    assert next(it) == "a"
    m.clear()
    m["c"] = 3  # as many changes since it was made as the table had then: still not the same table
    with pytest.raises(RuntimeError, match="changed size during iteration"):
        next(it)
    it = iter(m)
    m.__init__({"x": 1})  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="changed size during iteration"):
        next(it)
