"""CompletedSet: the live completed set and its as-of-open views (DESIGN §2, §2.4)."""

from __future__ import annotations

from tally_server.domain.checkpoint import CompletedSet


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
