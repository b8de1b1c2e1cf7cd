"""Parsing big HTTP bodies (tally_server.http_api.bodies): the same result as json.loads, counted."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from tally_server.domain.validation import Limits
from tally_server.errors import ResourceExhausted
from tally_server.http_api import bodies

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def load_slowly(raw: bytes, limit: int) -> Any:
    # b"" counts once per byte: any body longer than the limit takes the item-by-item path.
    return bodies.load(raw, items="deltas", limit=limit, mark=b"", marks_per_item=1)


@settings(max_examples=300)
@given(
    body=st.dictionaries(st.text(), _json, max_size=4),
    items=st.lists(_json, max_size=6),
    indent=st.sampled_from([None, 0, 2]),
)
def test_item_by_item_gives_what_json_loads_gives(
    body: dict[str, Any], items: list[Any], indent: int | None
) -> None:
    raw = json.dumps({**body, "deltas": items}, indent=indent).encode()
    assert load_slowly(raw, limit=len(items)) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b'{"deltas": [1, 2',
        b'{"deltas": [1,, 2]}',
        b'{"deltas": [1] 2}',
        b'{"deltas": []} x',
        b"[1",
    ],
)
def test_what_json_loads_refuses_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        load_slowly(raw, limit=10)


def test_counting_stops_past_the_limit() -> None:
    raw = json.dumps({"deltas": [1, 2, 3]}).encode()
    assert load_slowly(raw, limit=3) == {"deltas": [1, 2, 3]}
    with pytest.raises(bodies.TooMany):
        load_slowly(raw, limit=2)
    # Only the named member is counted.
    assert load_slowly(json.dumps({"other": [1, 2, 3], "deltas": []}).encode(), limit=0)["other"] == [1, 2, 3]


def test_a_batch_over_the_limit_is_refused_without_reading_it_whole() -> None:
    item = b'{"task_id": "t", "source_id": "s", "delta": 1}'
    raw = b'{"deltas": [' + b", ".join([item] * 11) + b", this is never read"
    with pytest.raises(ResourceExhausted, match="more than 10 deltas"):
        bodies.deltas(raw, Limits(max_deltas_per_call=10))


def test_deltas_are_strict_and_refusals_name_the_field() -> None:
    good = {"task_id": "t", "source_id": "s", "delta": -2}
    raw = json.dumps({"deltas": [good, good], "batch_seq": 3}).encode()
    batch, head = bodies.deltas(raw, Limits())
    assert (batch, head.batch_seq, head.ordered) == ((("t", "s", -2), ("t", "s", -2)), 3, False)
    columns = {"task_ids": ["t"], "source_ids": ["s"], "deltas": [-2]}
    raw = json.dumps({"columns": columns, "batch_seq": 4, "ordered": True}).encode()
    batch, head = bodies.deltas(raw, Limits())
    assert (batch, head.batch_seq, head.ordered) == ((("t", "s", -2),), 4, True)
    for bad, where in [
        ({"task_id": "t", "source_id": "s", "delta": True}, ("body", "deltas", 1, "delta")),
        ({"task_id": "t", "source_id": "s", "delta": "1"}, ("body", "deltas", 1, "delta")),
        ({"task_id": 5, "source_id": "s", "delta": 1}, ("body", "deltas", 1, "task_id")),
        ({"task_id": "t", "source_id": "s"}, ("body", "deltas", 1, "delta")),
    ]:
        with pytest.raises(RequestValidationError) as refused:
            bodies.deltas(json.dumps({"deltas": [good, bad]}).encode(), Limits())
        assert [e["loc"] for e in refused.value.errors()] == [where]
    with pytest.raises(RequestValidationError) as refused:
        bodies.deltas(json.dumps({"deltas": [good], "batch_seq": -1}).encode(), Limits())
    assert refused.value.errors()[0]["loc"] == ("body", "batch_seq")
    for form in ({"deltas": [good]}, {"columns": columns}):
        with pytest.raises(RequestValidationError) as refused:
            bodies.deltas(json.dumps({**form, "batch_seq": 1, "ordered": 1}).encode(), Limits())
        assert refused.value.errors()[0]["loc"] == ("body", "ordered")
