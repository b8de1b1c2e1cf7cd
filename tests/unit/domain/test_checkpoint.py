"""CompletedSet (the live completed set and its as-of-open views, DESIGN §2, §2.4) and unloading."""

from __future__ import annotations

import pytest

from tally_server.domain.checkpoint import Checkpoint, CompletedSet, choose_unloads


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
