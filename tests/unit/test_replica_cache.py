"""The replica's cache of completed ids (``replica_cache``) against a model of the database.

The model is what revision s0003 gives: completed ids per checkpoint and a number per checkpoint,
replaced from a sequence by every removal and given anew when a checkpoint is made again. Calls are
interleaved with each other and with the database's changes the way threads interleave them: a
call asks the cache, later its statement reads the database (one snapshot), later still it settles.
Every answer must be exactly what the database said at that snapshot, and the cache stays in its bound.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from tally_server.replica_cache import Asked, CompletedCache

CHECKPOINTS = ["a", "b"]
IDS = [b"1", b"2", b"3", b"4"]


@dataclass
class Database:
    """Completed ids and each checkpoint's number, as revision s0003's triggers keep them."""

    sequence: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    ids: dict[str, set[bytes]] = field(default_factory=dict)
    number: dict[str, int] = field(default_factory=dict)

    def complete(self, checkpoint: str, keys: list[bytes]) -> None:
        if checkpoint not in self.number:  # the first completion makes the row
            self.number[checkpoint] = next(self.sequence)
        self.ids.setdefault(checkpoint, set()).update(keys)

    def remove(self, checkpoint: str, keys: list[bytes]) -> None:
        self.ids.setdefault(checkpoint, set()).difference_update(keys)
        if checkpoint in self.number:  # the trigger, whether or not a row went
            self.number[checkpoint] = next(self.sequence)

    def reset(self, checkpoint: str) -> None:
        self.ids.pop(checkpoint, None)
        self.number.pop(checkpoint, None)

    def statement(self, checkpoint: str, asked: Asked) -> tuple[int | None, set[bytes], set[bytes]]:
        """``_ARE_COMPLETED_CACHED``: the number, the lacking ids found, the held ids found if stale."""
        number = self.number.get(checkpoint)
        held = self.ids.get(checkpoint, set())
        lacking = {k for k in asked.lacking if k in held}
        stale = {k for k in asked.held if k in held} if number != asked.number else set()
        return number, lacking, stale


keys_ = st.lists(st.sampled_from(IDS), min_size=1, max_size=4)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.sampled_from(CHECKPOINTS), keys_),  # ask, run, settle at once
        st.tuples(st.just("complete"), st.sampled_from(CHECKPOINTS), keys_),
        st.tuples(st.just("remove"), st.sampled_from(CHECKPOINTS), keys_),
        st.tuples(st.just("reset"), st.sampled_from(CHECKPOINTS), st.just([])),
        st.tuples(st.just("ask"), st.sampled_from(CHECKPOINTS), keys_),
        st.tuples(st.just("run"), st.integers(0, 3), st.just([])),
        st.tuples(st.just("settle"), st.integers(0, 3), st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=1000, deadline=None)
@given(steps=steps, max_ids=st.integers(0, 6))
def test_every_answer_is_the_databases_at_the_calls_snapshot(
    steps: list[tuple[str, str | int, list[bytes]]], max_ids: int
) -> None:
    db = Database()
    cache = CompletedCache(max_ids)
    asking: list[tuple[str, list[bytes], Asked]] = []  # asked, statement not run yet
    running: list[tuple[str, list[bytes], Asked, tuple[int | None, set[bytes], set[bytes]], list[bool]]] = []
    for op, what, keys in steps:
        if op == "complete":
            db.complete(str(what), keys)
        elif op == "remove":
            db.remove(str(what), keys)
        elif op == "reset":
            db.reset(str(what))
        elif op == "ask":
            asking.append((str(what), keys, cache.ask(str(what), keys)))
        elif op == "call":
            asked = cache.ask(str(what), keys)
            number, lacking, stale = db.statement(str(what), asked)
            settled = cache.settle(str(what), keys, asked, number, lacking | stale)
            assert settled.answers == [k in db.ids.get(str(what), set()) for k in keys]
        elif op == "run" and asking:
            checkpoint, asked_keys, asked = asking.pop(int(what) % len(asking))
            truth = [k in db.ids.get(checkpoint, set()) for k in asked_keys]
            running.append((checkpoint, asked_keys, asked, db.statement(checkpoint, asked), truth))
        elif op == "settle" and running:
            checkpoint, asked_keys, asked, (number, lacking, stale), truth = running.pop(
                int(what) % len(running)
            )
            settled = cache.settle(checkpoint, asked_keys, asked, number, lacking | stale)
            assert settled.answers == truth
            assert settled.hits <= sum(asked.cached)
        assert cache.size <= max_ids
        assert cache.size == sum(n for _, n in cache.checkpoints().values())


def test_hits_need_the_same_number_and_whole_checkpoints_are_evicted_least_recently_asked_first() -> None:
    cache = CompletedCache(4)
    asked = cache.ask("a", [b"1", b"2"])
    assert asked.number is None and asked.lacking == [b"1", b"2"] and asked.held == []
    assert cache.settle("a", [b"1", b"2"], asked, 7, {b"1"}).answers == [True, False]
    asked = cache.ask("a", [b"1", b"2", b"1"])
    assert (asked.number, asked.cached, asked.lacking, asked.held) == (
        7,
        [True, False, True],
        [b"2"],
        [b"1", b"1"],
    )
    settled = cache.settle("a", [b"1", b"2", b"1"], asked, 7, {b"2"})
    assert (settled.answers, settled.hits, settled.dropped) == ([True, True, True], 2, False)
    # Another number: the held ids were looked up too, and the statement's rows alone answer.
    asked = cache.ask("a", [b"1", b"2"])
    settled = cache.settle("a", [b"1", b"2"], asked, 9, {b"2"})
    assert (settled.answers, settled.hits, settled.dropped) == ([False, True], 0, True)
    assert cache.checkpoints() == {"a": (9, 1)}
    # The checkpoint is gone: nothing is kept for it.
    asked = cache.ask("a", [b"2"])
    assert cache.settle("a", [b"2"], asked, None, set()).answers == [False] and cache.checkpoints() == {}
    for name in ("b", "c"):
        cache.settle(name, [b"1", b"2"], cache.ask(name, [b"1", b"2"]), 1, {b"1", b"2"})
    cache.ask("b", [b"1"])  # b is now the most recently asked: c goes first
    settled = cache.settle("d", [b"1"], cache.ask("d", [b"1"]), 1, {b"1"})
    assert settled.evicted == 1 and list(cache.checkpoints()) == ["b", "d"] and cache.size == 3
    # One checkpoint past the bound by itself keeps what fits, after the others are evicted.
    many = [str(i).encode() for i in range(10)]
    settled = cache.settle("e", many, cache.ask("e", many), 1, set(many))
    assert settled.answers == [True] * 10 and settled.evicted == 2
    assert cache.checkpoints() == {"e": (1, 4)} and cache.size == 4


def test_a_call_that_read_an_older_snapshot_never_adds_its_ids_under_a_newer_number() -> None:
    """Threads settle in any order: a statement that ran before a removal, settling after a call that
    saw the removal's number, must not leave the removed id cached under that number."""
    db = Database()
    cache = CompletedCache(10)
    db.complete("a", [b"x", b"y"])
    early = cache.ask("a", [b"x"])
    early_read = db.statement("a", early)  # sees x, under the first number
    db.remove("a", [b"x"])  # a new number
    late = cache.ask("a", [b"y"])
    number, lacking, stale = db.statement("a", late)
    assert cache.settle("a", [b"y"], late, number, lacking | stale).answers == [True]
    number, lacking, stale = early_read
    assert cache.settle("a", [b"x"], early, number, lacking | stale).answers == [True]  # true then
    again = cache.ask("a", [b"x", b"y"])
    number, lacking, stale = db.statement("a", again)
    assert cache.settle("a", [b"x", b"y"], again, number, lacking | stale).answers == [False, True]
