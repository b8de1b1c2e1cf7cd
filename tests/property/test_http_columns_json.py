"""The SDK's ApplyDeltas body over HTTP, written directly, against ``json.dumps`` of the same body.

``http_convert.apply_deltas_body`` writes a batch of columns as JSON text itself when no id needs
escaping; whatever it writes must parse to exactly what ``json.dumps`` of the object would, and an
id it cannot write as it is (a quote, a backslash, a control character, non-ASCII) must leave the
object to ``json.dumps``.
"""

from __future__ import annotations

import json

from hypothesis import event, given
from hypothesis import strategies as st

from tally._transport import http_convert

plain = st.text(alphabet="ab_0 ~-\x7f", max_size=6)
odd = st.sampled_from(['"', "\\", "a\nb", "\x00", "é", "\U0001f600", "\ud800"])
values = st.integers(-300, 300) | st.integers(-(2**63), 2**63 - 1)


@st.composite
def deltas(draw: st.DrawFn) -> list[tuple[str, str, int]]:
    """A batch of plain ids; in about half of them one id that needs escaping."""
    batch = draw(st.lists(st.tuples(plain, plain, values), max_size=40))
    if batch and draw(st.booleans()):
        at, column = draw(st.integers(0, len(batch) - 1)), draw(st.integers(0, 1))
        row = list(batch[at])
        row[column] = draw(odd)
        batch[at] = (row[0], row[1], row[2])
    return batch


@given(deltas(), st.integers(0, 2**64 - 1), st.booleans())
def test_a_written_body_parses_as_json_dumps_of_the_object(
    batch: list[tuple[str, str, int]], batch_seq: int, ordered: bool
) -> None:
    body = http_convert.apply_deltas_body(batch, batch_seq, columns=True, ordered=ordered)
    expected: dict[str, object] = {"batch_seq": batch_seq} | ({"ordered": True} if ordered else {})
    if batch:
        task_ids, source_ids, numbers = (list(column) for column in zip(*batch, strict=True))
        expected["columns"] = {"task_ids": task_ids, "source_ids": source_ids, "deltas": numbers}
    else:
        expected["deltas"] = []
    event("written" if isinstance(body, bytes) else "left to json.dumps")
    sent = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert json.loads(sent) == expected


def test_only_ids_that_need_no_escaping_are_written_directly() -> None:
    plain = [("0_a", "a", 1), ("0_a_0", "a", -1), ("t~\x7f", "s 1", 300)]
    assert isinstance(http_convert.apply_deltas_body(plain, 1, columns=True), bytes)
    for odd in ['"', "\\", "\t", "é"]:
        body = http_convert.apply_deltas_body([*plain, ("t", odd, 1)], 1, columns=True)
        assert isinstance(body, dict), odd
