"""The compiled core's reading of ApplyDeltas' bytes against protobuf's and validation's.

``_ledgercore.parse_apply_deltas`` takes over only a plain batch of columns; whatever it takes, it
must read exactly as protobuf does (handle, batch number, ordered, every id and delta) and pack
exactly as validation does; whatever it leaves (None), protobuf and validation then decide.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tally.v1 import coordinator_pb2 as pb
from tally_server.domain import idmap, validation
from tests.conftest import compiled_core_required

LIMITS = validation.Limits()
ids = st.text(
    alphabet=st.characters(min_codepoint=1, max_codepoint=0x7F), min_size=1, max_size=8
) | st.sampled_from(["", "é", "x" * LIMITS.max_id_bytes, "y" * (LIMITS.max_id_bytes + 1), "a\x00b"])
deltas = st.integers(-3, 3) | st.sampled_from([2**62 - 1, -(2**62) + 1, 2**62, -(2**62), 2**63 - 1, -(2**63)])


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def zigzag(v: int) -> int:
    return (v << 1) ^ (v >> 63)


plain_ids = st.text(alphabet="abc_-.019", min_size=1, max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, bool]:
    """An ApplyDeltasRequest's bytes, and whether the compiled reading may leave them even if plain.

    It leaves DeltaColumns sent twice (protobuf merges them) and groups (a wire form tally.v1 never
    uses, which protobuf keeps as an unknown field).
    """
    if draw(st.booleans()):  # a batch validation passes as plain, but for what is appended below
        rows = draw(st.lists(st.tuples(plain_ids, plain_ids, st.integers(-3, 3)), max_size=6))
    else:
        rows = draw(st.lists(st.tuples(ids, ids, deltas), max_size=6))
    request = pb.ApplyDeltasRequest(
        handle=draw(st.sampled_from(["", "h1.0", "writer-handle"])),
        batch_seq=draw(st.sampled_from([0, 1, 2**64 - 1])),
        ordered=draw(st.booleans()),
    )
    form = draw(st.sampled_from(["columns", "columns", "rows", "none"]))
    if form == "columns":
        cols = request.columns
        cols.task_ids.extend(t for t, _, _ in rows)
        cols.source_ids.extend(s for _, s, _ in rows)
        cols.deltas.extend(d for _, _, d in rows)
        if draw(st.integers(0, 4)) == 0 and rows:  # a column one short: the lengths differ
            del cols.source_ids[-1]
    elif form == "rows":
        request.deltas.extend(pb.Delta(task_id=t, source_id=s, delta=d) for t, s, d in rows)
    data = request.SerializeToString()
    extra = draw(st.sampled_from(["", "unknown", "unpacked", "columns again", "group", "truncated"]))
    if extra == "unknown":  # fields of tally.v1's future: skipped by both
        data += varint(99 << 3 | 0) + varint(5) + varint(98 << 3 | 2) + varint(3) + b"abc"
        data += varint(97 << 3 | 5) + b"\x00" * 4 + varint(96 << 3 | 1) + b"\x00" * 8
    elif extra == "unpacked" and form == "columns":  # one more delta, not packed
        data += varint(4 << 3 | 2) + varint(len(inner := varint(3 << 3) + varint(zigzag(1))))
        data += inner
    elif extra == "columns again":  # protobuf merges a second DeltaColumns into the first
        inner = varint(1 << 3 | 2) + varint(1) + b"t" + varint(2 << 3 | 2) + varint(1) + b"s"
        data += varint(4 << 3 | 2) + varint(len(inner)) + inner + varint(4 << 3 | 2) + varint(0)
    elif extra == "group":
        data += varint(50 << 3 | 3) + varint(50 << 3 | 4)
    elif extra == "truncated" and data:
        data = data[:-1]
    event(f"{form}, {extra or 'plain'}")
    twice = extra in ("unpacked", "columns again") and form == "columns" or extra == "columns again"
    return data, twice or extra == "group"


@pytest.fixture(autouse=True)
def _compiled() -> None:
    compiled_core_required()


@settings(max_examples=3000, deadline=None)
@given(requests())
def test_the_compiled_reading_is_protobufs_and_validations(request_bytes: tuple[bytes, bool]) -> None:
    data, may_leave = request_bytes
    assert idmap.COMPILED is not None and idmap.COMPILED.parse_apply_deltas is not None
    got = idmap.COMPILED.parse_apply_deltas(data, LIMITS.max_id_bytes, LIMITS.max_deltas_per_call)
    try:
        request = pb.ApplyDeltasRequest.FromString(data)
    except Exception:  # protobuf refuses the bytes: so must the compiled reading (it leaves them)
        assert got is None
        return
    plain = None
    if request.HasField("columns") and not request.deltas:
        cols = request.columns
        try:
            plain = validation.delta_columns(cols.task_ids, cols.source_ids, cols.deltas, LIMITS, int64=True)
        except validation.InvalidArgument:
            plain = None
        else:
            if plain.packed is None:
                plain = None  # valid, but not plain ASCII: validation's careful path
    if got is None:
        # Left to protobuf: only what validation would not pass as plain, or what it may leave.
        assert plain is None or may_leave, "a plain batch of columns was left to protobuf"
        return
    event("read by the compiled core")
    handle, batch_seq, ordered, tasks, sources, values, packed = got
    assert (handle, batch_seq, ordered) == (request.handle, request.batch_seq, request.ordered)
    assert plain is not None, "the compiled reading took a batch validation would not pass as plain"
    assert (tasks, sources, values) == (plain.task_ids, plain.source_ids, plain.values)
    assert packed == plain.packed


def test_a_source_that_comes_again_is_the_same_str() -> None:
    """A batch holds several deltas per source: the reading makes one str for the bytes it saw a
    little earlier (its hash then computed once), and each id still reads as sent: 3,000 sources
    (more than the reading remembers, so they share its slots), each sent 1 to 3 times, apart."""
    assert idmap.COMPILED is not None and idmap.COMPILED.parse_apply_deltas is not None
    distinct = [f"{i * 7919:012x}" for i in range(3_000)]
    sources = [sid for i, sid in enumerate(distinct) for _ in range(1 + i % 3)]
    sources += distinct[::-1]  # each again, far from where it came first
    request = pb.ApplyDeltasRequest(handle="h1.0")
    request.columns.task_ids.extend(f"t{i}" for i in range(len(sources)))
    request.columns.source_ids.extend(sources)
    request.columns.deltas.extend([1] * len(sources))
    got = idmap.COMPILED.parse_apply_deltas(request.SerializeToString(), 1024, 100_000)
    assert got is not None
    tasks, read = got[3], got[4]
    assert read == sources and tasks == [f"t{i}" for i in range(len(sources))]
    assert read[1] is read[2] and read[3] is read[4] is read[5]  # the same source, one str
    assert read[0] is not read[1] and len({id(t) for t in tasks}) == len(tasks)
    # Apart: shared when its slot still held it, a str of its own otherwise; never another id's.
    assert len({id(s) for s in read}) < len(sources) - len(distinct)
