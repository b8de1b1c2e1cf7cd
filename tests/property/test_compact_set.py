"""The compact completed set against the plain dict it replaced (id -> completion sequence).

Hypothesis drives adds (into writer files), discards one by one and many at once (with the delete
reaching the files, or not yet), views taken at any moment, and merges of the overlay into the
compact index; after every step the live set, its length, the batch lookup and every view taken so
far must answer exactly as the model. Run with Python's hash and with one that collides on purpose
(every id into four buckets), so that hash hits that are not the id are exercised all the time.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tally_server.domain import idmap
from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.compact import CompactIndex, Hasher, distinct_count
from tests.conftest import compiled_core_required

IDS = [f"s{i}" for i in range(12)] + ["é", "ü-long-id"]
ORIGINS = ["w0", "w1", "w2"]


def colliding(key: bytes) -> int:
    return zlib.crc32(key) % 4


class Model:
    """The set as it was: a dict of id -> sequence, the sequence bumped by every add."""

    def __init__(self, initial: Sequence[str]) -> None:
        self.seq = 0
        self.completed = dict.fromkeys(initial, 0)

    def add(self, sources: Sequence[str]) -> None:
        self.seq += 1
        for sid in sources:
            self.completed.setdefault(sid, self.seq)

    def view(self) -> Callable[[str], bool]:
        cutoff, completed = self.seq, self.completed
        return lambda sid: sid in completed and completed[sid] <= cutoff


class CompactSetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, set[bytes]] = {}
        self.views: list[tuple[Callable[[str], bool], Callable[[str], bool]]] = []

    def confirm(self, origin: str, keys: Sequence[bytes]) -> list[bool]:
        held = self.files.get(origin, set())
        return [key in held for key in keys]

    @initialize(
        initial=st.dictionaries(st.sampled_from(IDS), st.sampled_from(ORIGINS), max_size=8),
        collide=st.booleans(),
        merge_at=st.integers(1, 4),
    )
    def load(self, initial: dict[str, str], collide: bool, merge_at: int) -> None:
        hasher = Hasher(colliding) if collide else Hasher()
        for sid, origin in initial.items():
            self.files.setdefault(origin, set()).add(sid.encode())
        origins = sorted(self.files)
        index = CompactIndex.build([hasher.of_keys(sorted(self.files[o])) for o in origins])
        self.compact = CompletedSet(
            index=index, origins=origins, confirm=self.confirm, hasher=hasher, merge_at=merge_at
        )
        # A load counts one id per hash prefix; the loader corrects that with the shared ones' keys.
        shared = set(index.shared_prefixes().tolist())
        keys = [k for held in self.files.values() for k in held if index.prefix(hasher.of_key(k)) in shared]
        index.count = distinct_count(index, hasher, keys)
        self.model = Model(list(initial))
        self.declared: set[str] = set()

    @rule(sources=st.lists(st.sampled_from(IDS), max_size=4), origin=st.sampled_from(ORIGINS))
    def add(self, sources: list[str], origin: str) -> None:
        # Committed to the writer's file first, then made durable in the live set. A writer never
        # completes again into its own file what that file already holds completed (its ledger
        # makes that an anomaly), so ids the file holds and the set counts are left out.
        held = self.files.setdefault(origin, set())
        sources = [s for s in sources if not (s in self.model.completed and s.encode() in held)]
        held.update(s.encode() for s in sources)
        # A ledger's completions come without repeats and are taken as they are (``distinct``).
        if len(sources) == len(set(sources)):
            self.compact.add(sources, origin, distinct=True)
        else:
            self.compact.add(sources, origin)
        self.model.add(sources)

    @rule(sid=st.sampled_from(IDS), reaches_files=st.booleans())
    def discard(self, sid: str, reaches_files: bool) -> None:
        expected = sid in self.model.completed
        assert self.compact.discard(sid) is expected
        self.model.completed.pop(sid, None)
        if reaches_files:  # the delete was committed (or is still to be retried)
            for held in self.files.values():
                held.discard(sid.encode())

    @rule(sources=st.lists(st.sampled_from(IDS), max_size=5), reaches_files=st.booleans())
    def discard_many(self, sources: list[str], reaches_files: bool) -> None:
        # An anomalous batch's un-completes, all at once (repeats included).
        expected = len(set(sources) & self.model.completed.keys())
        assert self.compact.discard_many(sources) == expected
        for sid in sources:
            self.model.completed.pop(sid, None)
            if reaches_files:
                for held in self.files.values():
                    held.discard(sid.encode())

    @rule(sources=st.lists(st.sampled_from(IDS), max_size=5))
    def declare(self, sources: list[str]) -> None:
        # What the service does on DeclareSources: add the new ids to the checkpoint's declared set
        # (the object the completed set watches) and count the completed among them.
        new = [s for s in dict.fromkeys(sources) if s not in self.declared]
        self.declared.update(new)
        if self.compact.declared is self.declared:
            done = self.compact.declared_done + sum(self.compact.contains_many(new))
        else:
            done = sum(self.compact.contains_many(list(self.declared)))
        self.compact.watch(self.declared, done)

    @rule()
    def view(self) -> None:
        self.views.append((self.compact.as_of_now(), self.model.view()))

    @rule()
    def merge(self) -> None:
        self.compact.merge()

    @rule(sid=st.sampled_from(IDS), reaches_files=st.booleans(), origin=st.sampled_from(ORIGINS))
    def merge_beside_changes(self, sid: str, reaches_files: bool, origin: str) -> None:
        # The service builds a merge in a load thread while the set goes on changing.
        plan = self.compact.plan_merge()
        self.discard(sid, reaches_files)
        self.add([sid], origin)
        self.view()
        if plan is not None:
            self.compact.finish_merge(plan, plan.build())

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "compact"):
            return
        assert len(self.compact) == len(self.model.completed)
        # Kept count of as ids come and go (merge_due reads it); a merge no longer recounts it.
        assert self.compact._mergeable == self.compact.mergeable_recounted()
        # The overlay's characters, kept (the memory estimate) as ids come, go and merge.
        assert self.compact._id_chars == sum(map(len, self.compact._overlay))
        if self.compact.declared is self.declared:  # declared totals: remaining is exact
            assert self.compact.declared_done == len(self.declared & self.model.completed.keys())
        live = [sid in self.model.completed for sid in IDS]
        assert [sid in self.compact for sid in IDS] == live
        assert self.compact.contains_many(IDS) == live
        for compact_view, model_view in self.views:
            expected = [model_view(sid) for sid in IDS]
            assert [compact_view(sid) for sid in IDS] == expected
            assert compact_view.many(IDS) == expected  # type: ignore[attr-defined]


TestCompactSet = CompactSetMachine.TestCase
TestCompactSet.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PythonCoreSetMachine(CompactSetMachine):
    """The same on the pure Python core (the overlay's ids added with dict passes, not set_absent)."""

    def __init__(self) -> None:
        super().__init__()
        self.core_before = idmap.current().name
        idmap.use("python")

    def teardown(self) -> None:
        idmap.use(self.core_before)


TestCompactSetPythonCore = PythonCoreSetMachine.TestCase
TestCompactSetPythonCore.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)


def test_set_absent_adds_only_what_the_dict_lacks() -> None:
    compiled_core_required()
    assert idmap.COMPILED is not None and idmap.COMPILED.set_absent is not None
    set_absent = idmap.COMPILED.set_absent
    overlay = {"a": 1, "b": 3}
    assert set_absent(overlay, ["x", "y"], 3) is None  # every one added: the caller's list stands
    assert overlay == {"a": 1, "b": 3, "x": 3, "y": 3}
    # "b" holds the same small int (one object): it was there, so it is not counted as added.
    assert set_absent(overlay, ["z", "b", "a", "w", "z"], 3) == ["z", "w"]
    assert overlay == {"a": 1, "b": 3, "x": 3, "y": 3, "z": 3, "w": 3}
    assert set_absent(overlay, ["a"], 9) == [] and overlay["a"] == 1
    assert set_absent({}, [], 0) is None


@given(st.lists(st.sampled_from(IDS), unique=True))
def test_an_index_built_from_files_holds_exactly_their_ids(ids: list[str]) -> None:
    files = {"w0": {s.encode() for s in ids[::2]}, "w1": {s.encode() for s in ids[1::2]}}
    hasher = Hasher()
    index = CompactIndex.build([hasher.of_keys(sorted(files[o])) for o in ("w0", "w1")])
    completed = CompletedSet(
        index=index,
        origins=["w0", "w1"],
        confirm=lambda origin, keys: [k in files[origin] for k in keys],
        hasher=hasher,
    )
    assert len(completed) == len(ids)
    assert completed.contains_many(IDS) == [sid in ids for sid in IDS]
