"""The SDK's check of ``apply_deltas`` input: the quick column check decides as the item-by-item one."""

from __future__ import annotations

import operator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tally._writer.support import validated
from tally.errors import InvalidArgument


def _one_by_one(items: list[Any]) -> list[tuple[str, str, int]] | str:
    """The reference: each item on its own; the refusal of the first bad one."""
    out = []
    for i, item in enumerate(items):
        try:
            task_id, source_id, raw = item
            delta = operator.index(raw)
            ok = isinstance(task_id, str) and isinstance(source_id, str) and not isinstance(raw, bool)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return f"deltas[{i}] = {item!r} is not a (task_id: str, source_id: str, delta: int) tuple"
        out.append((task_id, source_id, delta))
    return out


class _Str(str):
    pass


_parts = st.one_of(
    st.text(max_size=3), st.builds(_Str, st.text(max_size=2)), st.integers(-3, 3), st.booleans(), st.none()
)
_items = st.one_of(
    st.tuples(st.text(max_size=3), st.text(max_size=3), st.integers(-(2**70), 2**70)),  # plain
    st.tuples(_parts, _parts, _parts),
    st.lists(_parts, min_size=2, max_size=4).map(tuple),
    st.lists(_parts, min_size=3, max_size=3),  # a list, not a tuple
    st.text(min_size=3, max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_items, max_size=6))
def test_input_is_taken_or_refused_exactly_as_item_by_item(items: list[Any]) -> None:
    expected = _one_by_one(items)
    if isinstance(expected, str):
        try:
            validated(items)
        except InvalidArgument as exc:
            assert exc.message == expected
        else:
            raise AssertionError(f"{items!r} was taken; expected {expected!r}")
    else:
        got = validated(items)
        assert got == expected
        assert [tuple(map(type, d)) for d in got] == [tuple(map(type, d)) for d in expected]


def test_plain_tuples_are_taken_as_they_are() -> None:
    items = [("t", "s", 1), ("u", "s", -1)]
    got = validated(iter(items))
    assert got == items and all(a is b for a, b in zip(got, items, strict=True))
