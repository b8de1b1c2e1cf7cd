"""CompletedSet (the live completed set and its as-of-open views, DESIGN §2, §2.4) and unloading."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import pytest

from tally_server.domain.checkpoint import Checkpoint, CompletedSet, choose_unloads
from tally_server.domain.compact import CompactIndex, Hasher


def test_initial_sources_are_visible_to_views_taken_at_once() -> None:
    completed = CompletedSet(["a", "b"])
    view = completed.as_of_now()
    assert view("a") and view("b")
    assert not view("c")
    assert len(completed) == 2
    assert "a" in completed
    assert sorted(completed.sources()) == ["a", "b"]


def test_a_view_does_not_see_later_additions_but_the_live_set_does() -> None:
    completed = CompletedSet(["a"])
    view = completed.as_of_now()
    completed.add(["b", "c"])
    assert "b" in completed
    assert not view("b")
    assert not view("c")
    assert completed.as_of_now()("b")


@pytest.mark.parametrize("first", [[], ["a"]])
def test_a_view_of_a_set_then_empty_sees_nothing_added_later(first: list[str]) -> None:
    completed = CompletedSet(first)
    completed.discard("a")  # empty now, whether it never held anything or held "a"
    view = completed.as_of_now()
    completed.add(["a", "b"], "w1")
    completed.add(["c"])
    assert len(completed) == 3
    assert not any(view(sid) for sid in "abcd")
    assert view.many(["a", "b", "c", "d"]) == [False] * 4  # type: ignore[attr-defined]
    assert completed.as_of_now().many(["a", "b", "c", "d"]) == [True, True, True, False]  # type: ignore[attr-defined]


def test_a_view_sees_discards_at_once() -> None:
    completed = CompletedSet(["a"])
    view = completed.as_of_now()
    assert completed.discard("a") is True
    assert completed.discard("a") is False
    assert not view("a")
    assert "a" not in completed


def test_a_source_discarded_and_completed_again_later_is_invisible_to_older_views() -> None:
    completed = CompletedSet(["a"])
    old_view = completed.as_of_now()
    completed.discard("a")
    completed.add(["a"])
    assert "a" in completed
    assert not old_view("a")
    assert completed.as_of_now()("a")


def test_adding_an_already_completed_source_keeps_its_first_completion() -> None:
    completed = CompletedSet()
    completed.add(["a"])
    view = completed.as_of_now()
    completed.add(["a"])  # another writer completes it again into its own file
    assert view("a")
    assert completed.sources() == ["a"]


def test_byte_order_follows_additions_and_removals() -> None:
    completed = CompletedSet(["b", "é", "a"])
    assert completed.in_byte_order() == [b"a", b"b", "é".encode()]
    completed.add(["c"])
    assert completed.in_byte_order() == [b"a", b"b", b"c", "é".encode()]
    completed.discard("a")
    assert completed.in_byte_order() == [b"b", b"c", "é".encode()]


def _loaded(name: str, ids: int, last_used: float) -> Checkpoint:
    cp = Checkpoint(name=name, created_at=0.0, last_activity_at=0.0)
    cp.completed = CompletedSet(f"{name}-{i}" for i in range(ids))
    cp.last_used = last_used
    return cp


def test_unloads_least_recently_used_first_until_the_loaded_ones_fit() -> None:
    old, mid, new = _loaded("old", 1000, 1.0), _loaded("mid", 1000, 2.0), _loaded("new", 1000, 3.0)
    one = old.ids().estimated_bytes()
    chosen = choose_unloads(
        [new, old, mid], budget_bytes=int(1.5 * one), busy=lambda cp: False, used_before=10.0
    )
    assert [cp.name for cp in chosen] == ["old", "mid"]


def test_never_unloads_a_busy_or_recently_used_checkpoint() -> None:
    busy, recent, idle = _loaded("busy", 1000, 1.0), _loaded("recent", 1000, 9.5), _loaded("idle", 1000, 2.0)
    chosen = choose_unloads(
        [busy, recent, idle], budget_bytes=0, busy=lambda cp: cp.name == "busy", used_before=9.0
    )
    assert [cp.name for cp in chosen] == ["idle"]


def test_an_unloaded_checkpoint_keeps_its_count() -> None:
    cp = _loaded("x", 42, 0.0)
    cp.unload()
    assert cp.completed is None and cp.completed_count == 42
    with pytest.raises(RuntimeError, match="not loaded"):
        cp.ids()


def test_estimated_bytes_follow_additions_and_removals() -> None:
    completed = CompletedSet(["aaaa"])
    one = completed.estimated_bytes()
    completed.add(["bbbb", "aaaa"])
    assert completed.estimated_bytes() == 2 * one
    completed.discard("aaaa")
    assert completed.estimated_bytes() == one
    completed.in_byte_order()  # nothing is cached for paging: pages are read from the files
    assert completed.estimated_bytes() == one


def _files_set(
    key_hash: Callable[[bytes], int] | None = None, initial: tuple[str, ...] = ()
) -> tuple[CompletedSet, dict[str, set[bytes]]]:
    """A compact set over writer files (a dict of file -> keys), merging only when asked.

    ``initial``: ids it starts with that no file holds (they never merge).
    """
    files: dict[str, set[bytes]] = {}
    completed = CompletedSet(
        initial,
        index=CompactIndex.build([]),
        confirm=lambda origin, keys: [key in files.get(origin, set()) for key in keys],
        hasher=Hasher(key_hash),
        merge_at=10**9,
    )
    return completed, files


def _commit(completed: CompletedSet, files: dict[str, set[bytes]], sids: list[str], origin: str) -> None:
    files.setdefault(origin, set()).update(sid.encode() for sid in sids)
    completed.add(sids, origin)


class _CountingHasher(Hasher):
    def __init__(self) -> None:
        super().__init__()
        self.hashed = 0

    def of_ids(self, ids: Sequence[str]) -> npt.NDArray[np.uint64]:
        self.hashed += len(ids)
        return super().of_ids(ids)


def test_planning_a_merge_only_snapshots_the_overlay_and_its_build_hashes_the_ids() -> None:
    """``plan_merge`` runs on the event loop (``CheckpointTable._merge``), ``build`` in a load thread:
    hashing the ids and sorting their prefixes on the loop stalled it 122-138 ms at 400,000 ids."""
    hasher = _CountingHasher()
    files: dict[str, set[bytes]] = {}
    completed = CompletedSet(
        index=CompactIndex.build([]),
        confirm=lambda origin, keys: [key in files.get(origin, set()) for key in keys],
        hasher=hasher,
        merge_at=10**9,
    )
    ids = [f"s{i}" for i in range(100)]
    _commit(completed, files, ids, "w0")
    before = hasher.hashed
    plan = completed.plan_merge()
    assert plan is not None and hasher.hashed == before
    merged = plan.build()
    assert hasher.hashed == before + len(ids)
    completed.finish_merge(plan, merged)
    assert not completed._overlay and completed.contains_many([*ids, "s100"]) == [True] * len(ids) + [False]


@pytest.mark.usefixtures("each_lookup")
def test_a_merge_of_the_whole_overlay_keeps_what_was_added_while_it_was_built() -> None:
    completed, files = _files_set()
    _commit(completed, files, ["x", "y"], "w0")
    plan = completed.plan_merge()
    assert plan is not None and plan.whole and plan.sids == ["x", "y"]
    _commit(completed, files, ["z"], "w1")  # while the merge builds in a load thread
    completed.finish_merge(plan, plan.build())
    assert list(completed._overlay) == ["z"]
    assert completed.contains_many(["x", "y", "z", "w"]) == [True, True, True, False]
    assert len(completed) == 3
    assert completed.mergeable_recounted() == 1 == completed._mergeable


@pytest.mark.usefixtures("each_lookup")
def test_a_merge_that_leaves_ids_in_the_overlay_moves_only_the_ones_it_planned() -> None:
    # "a" and "b" share their whole hash: neither may move (the index could not tell them apart).
    completed, files = _files_set(lambda key: 7 if key in (b"a", b"b") else zlib.crc32(key) << 20)
    _commit(completed, files, ["a", "x", "b", "y"], "w0")
    plan = completed.plan_merge()
    assert plan is not None
    _commit(completed, files, ["z"], "w0")
    merged = plan.build()  # it finds which ids can move, beside the set (which goes on changing)
    assert not plan.whole and plan.sids == ["x", "y"]
    completed.finish_merge(plan, merged)
    assert list(completed._overlay) == ["a", "b", "z"]
    assert completed.contains_many(["a", "b", "x", "y", "z", "w"]) == [True] * 5 + [False]
    assert len(completed) == 5
    assert completed.mergeable_recounted() == 3 == completed._mergeable


@pytest.mark.usefixtures("each_lookup")
def test_a_merge_leaves_ids_without_a_file_where_they_are() -> None:
    completed, files = _files_set(initial=("i",))
    _commit(completed, files, ["x", "y"], "w0")
    plan = completed.plan_merge()
    assert plan is not None and not plan.whole and plan.sids == ["x", "y"]
    _commit(completed, files, ["z"], "w0")
    completed.finish_merge(plan, plan.build())
    assert list(completed._overlay) == ["i", "z"]
    assert completed.contains_many(["i", "x", "y", "z"]) == [True] * 4
    assert completed.mergeable_recounted() == 1 == completed._mergeable
