"""The routing rules of a store of several shards: routing keys, handles, and who holds which shard."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tally.v1 import coordinator_pb2 as pb
from tally_server.sharding import (
    ROUTE_BY_CHECKPOINT,
    ROUTE_BY_HANDLE,
    desired_shards,
    field_one,
    handle_shard,
    tag_handle,
)

names = st.text(min_size=1, max_size=40)
replica_names = st.lists(
    st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=12), min_size=1, max_size=6, unique=True
)


@given(names, st.lists(st.text(max_size=10), max_size=20))
def test_field_one_reads_the_checkpoint_of_any_request_without_parsing_it(name: str, ids: list[str]) -> None:
    raw = pb.AreCompletedRequest(checkpoint=name, source_ids=ids).SerializeToString()
    assert field_one(raw) == name


def test_field_one_reads_the_handle_past_big_batches_and_whatever_the_field_order() -> None:
    request = pb.ApplyDeltasRequest(handle="h.3", batch_seq=7)
    request.deltas.add(task_id="t", source_id="s", delta=1)
    request.columns.source_ids.extend(["x"] * 1000)
    raw = request.SerializeToString()
    assert field_one(raw) == "h.3"
    # Field 1 after the others (allowed on the wire) and repeated (the last wins, as protobuf reads it).
    tail = pb.ApplyDeltasRequest(handle="first").SerializeToString()
    again = pb.ApplyDeltasRequest(handle="last").SerializeToString()
    reordered = pb.ApplyDeltasRequest(batch_seq=7).SerializeToString() + tail + again
    assert pb.ApplyDeltasRequest.FromString(reordered).handle == field_one(reordered) == "last"
    assert field_one(b"") == ""  # absent: the default


def test_field_one_says_none_for_bytes_that_are_not_a_message() -> None:
    for raw in (b"\x0a\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0a\x02\xff\xfe", b"\x0f"):
        assert field_one(raw) is None, raw


def test_every_routed_request_has_its_routing_key_as_field_one() -> None:
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    for name in ROUTE_BY_CHECKPOINT | ROUTE_BY_HANDLE:
        request = service.methods_by_name[name].input_type
        field = request.fields_by_number[1]
        expected = {"handle"} if name in ROUTE_BY_HANDLE else {"checkpoint", "name"}
        assert field.name in expected and field.type == field.TYPE_STRING, name
    # Every call with such a field is routed: a new one cannot slip through unrouted.
    for method in service.methods:
        first = method.input_type.fields_by_number.get(1)
        if first is not None and first.name in {"handle", "checkpoint", "name"}:
            assert method.name in ROUTE_BY_CHECKPOINT | ROUTE_BY_HANDLE, method.name


@given(st.text(alphabet="0123456789abcdef", min_size=1, max_size=32), st.integers(0, 255))
def test_a_tagged_handle_names_its_shard(handle: str, shard: int) -> None:
    assert handle_shard(tag_handle(handle, shard)) == shard


def test_a_handle_without_a_shard_is_answered_where_it_arrives() -> None:
    for handle in ("0123abcd", "", "x.", "x.y", "a.12345"):
        assert handle_shard(handle) is None, handle


@given(st.integers(1, 64), replica_names)
def test_each_shard_has_exactly_one_holder_whoever_computes_it(shards: int, live: list[str]) -> None:
    views = {me: desired_shards(shards, [n for n in live if n != me], me) for me in live}
    assert sorted(s for held in views.values() for s in held) == list(range(shards))


@given(st.integers(1, 64), replica_names)
def test_the_shards_are_shared_evenly(shards: int, live: list[str]) -> None:
    sizes = sorted(len(desired_shards(shards, live, me)) for me in live)
    assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == shards


@settings(max_examples=500)
@given(st.integers(8, 64), replica_names, st.text(alphabet="xyz", min_size=1, max_size=5))
def test_a_joining_replica_moves_few_shards_besides_its_own_share(
    shards: int, live: list[str], joining: str
) -> None:
    before = {me: desired_shards(shards, live, me) for me in live}
    after = {me: desired_shards(shards, [*live, joining], me) for me in live}
    taken = desired_shards(shards, live, joining)
    moved = sum(len(before[m] - after[m]) for m in live)
    assert len(taken) >= shards // (len(live) + 1)
    # What moves besides the joiner's share (the capacities shifting): never more than that share
    # again, so a join costs far less than reshuffling everything.
    assert moved - len(taken) <= len(taken) + len(live), (moved, len(taken))
