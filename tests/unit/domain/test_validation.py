"""Input refusals (DESIGN §4, §7): each names what was wrong and, for limits, the setting and value."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally_server.domain import validation
from tally_server.domain.validation import Limits
from tally_server.errors import ErrorCode, InvalidArgument, ResourceExhausted

LIMITS = Limits()

# --- checkpoint names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("..", "invalid segment '..'"),
        ("a/../b", "invalid segment '..'"),
        ("a/..", "invalid segment '..'"),
        (".", "invalid segment '.'"),
        ("a/./b", "invalid segment '.'"),
        ("/abs", "no leading '/'"),
        ("/etc/passwd", "no leading '/'"),
        ("a\\b", "no backslash"),
        ("..\\x", "no backslash"),
        ("a\x00b", "no NUL"),
        ("a//b", "invalid segment ''"),
        ("a/", "invalid segment ''"),
        ("", "is empty"),
        ("a" * 256, "256 bytes, over the limit of 255 (setting max_name_bytes)"),
        ("\ud800", "not valid UTF-8"),
        ("run/\udcff", "not valid UTF-8"),
        ("a/.nemo_curator_metadata", "invalid segment '.nemo_curator_metadata'"),
        ("-rf", "invalid segment '-rf'"),
        ("a b", "invalid segment 'a b'"),
    ],
)
def test_checkpoint_names_that_escape_or_break_are_refused(name: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validation.checkpoint_name(name, LIMITS)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT
    assert refused.value.message.startswith("checkpoint name ")
    assert problem in refused.value.message


def test_over_long_checkpoint_name_counts_utf8_bytes_not_characters() -> None:
    with pytest.raises(
        InvalidArgument, match=r"is 12 bytes, over the limit of 10 \(setting max_name_bytes\)"
    ):
        validation.checkpoint_name("ab" + "é" * 5, Limits(max_name_bytes=10))


@pytest.mark.parametrize("name", ["curation/run-42", "a.b_c-1", "_x", "A/B/C", "run.v2/shard_7", "a" * 255])
def test_good_checkpoint_names_are_accepted(name: str) -> None:
    assert validation.checkpoint_name(name, LIMITS) == name


# --- writer ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "is not allowed"),
        (".", "'.' is not allowed"),
        ("..", "'..' is not allowed"),
        ("a/b", "'a/b' is not allowed"),
        ("../x", "'../x' is not allowed"),
        ("a\\b", "is not allowed"),
        ("a\x00", "is not allowed"),
        ("-x", "'-x' is not allowed"),
        ("host 1", "'host 1' is not allowed"),
        ("\ud800", "not valid UTF-8"),
        ("w" * 256, "256 bytes, over the limit of 251 (it names the file <writer_id>.mdb"),
    ],
)
def test_bad_writer_ids_are_refused(value: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validation.writer_id(value, LIMITS)
    assert refused.value.message.startswith("writer_id ")
    assert problem in refused.value.message


@pytest.mark.parametrize("value", ["host-1234", "node01.cluster.local-99", "_w", "W" * 200])
def test_good_writer_ids_are_accepted(value: str) -> None:
    assert validation.writer_id(value, LIMITS) == value


def test_writer_id_leaves_room_for_the_mdb_suffix() -> None:
    with pytest.raises(InvalidArgument):
        validation.writer_id("w" * 252, LIMITS)


# --- ids in deltas and queries ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "problem"),
    [
        ([("", "s", 1)], "deltas[0].task_id is empty"),
        ([("t", "s", 1), ("t2", "", 1)], "deltas[1].source_id is empty"),
        ([("t" * 9, "s", 1)], "deltas[0].task_id is 9 bytes, over the limit of 8 (setting max_id_bytes)"),
        ([("t", "é" * 5, 1)], "deltas[0].source_id is 10 bytes, over the limit of 8 (setting max_id_bytes)"),
        ([("t", "s", 1), ("\udcff", "s", 1)], "deltas[1].task_id is not valid UTF-8"),
        ([("t", "s\ud800", 1)], "deltas[0].source_id is not valid UTF-8"),
        ([("t", "s", 2**62)], "deltas[0].delta 4611686018427387904 is out of range"),
        ([("t", "s", -(2**62))], "deltas[0].delta -4611686018427387904 is out of range"),
    ],
)
def test_bad_ids_in_a_batch_are_refused(batch: list[tuple[str, str, int]], problem: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validation.deltas(batch, Limits(max_id_bytes=8))
    assert problem in refused.value.message


def test_ids_at_the_byte_limit_are_accepted() -> None:
    limits = Limits(max_id_bytes=8)
    validation.deltas([("t" * 8, "é" * 4, -(2**62) + 1), ("x", "y", 2**62 - 1)], limits)
    validation.source_ids(["s" * 8, "é" * 4], limits)


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        (["a", ""], "source_ids[1] is empty"),
        (["s" * 9], "source_ids[0] is 9 bytes, over the limit of 8 (setting max_id_bytes)"),
        (["\udcff"], "source_ids[0] is not valid UTF-8"),
    ],
)
def test_bad_ids_in_a_query_are_refused(ids: list[str], problem: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validation.source_ids(ids, Limits(max_id_bytes=8))
    assert problem in refused.value.message


def test_default_id_limit_fits_an_lmdb_key() -> None:
    with pytest.raises(InvalidArgument):
        validation.deltas([("t", "s" * 512, 1)], Limits())


# --- batch and query sizes -------------------------------------------------------------------------


def test_batch_over_max_deltas_per_call_is_resource_exhausted() -> None:
    limits = Limits(max_deltas_per_call=3)
    validation.deltas([("t", "s", 1)] * 3, limits)
    with pytest.raises(ResourceExhausted) as refused:
        validation.deltas([("t", "s", 1)] * 4, limits)
    assert refused.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert refused.value.message == (
        "batch has 4 deltas, over the limit of 3 (setting max_deltas_per_call); send smaller batches"
    )


def test_query_over_max_ids_per_query_is_resource_exhausted() -> None:
    limits = Limits(max_ids_per_query=2)
    validation.source_ids(["a", "b"], limits)
    with pytest.raises(ResourceExhausted) as refused:
        validation.source_ids(["a", "b", "c"], limits)
    assert "3 source ids, over the limit of 2 (setting max_ids_per_query)" in refused.value.message


def test_oversize_batch_is_refused_before_its_ids_are_looked_at() -> None:
    with pytest.raises(ResourceExhausted):
        validation.deltas([("", "", 1)] * 2, Limits(max_deltas_per_call=1))


# --- labels ----------------------------------------------------------------------------------------


def test_labels_over_limits_are_refused() -> None:
    validation.labels({"slurm_job": "123", "team": "curation"}, Limits(max_labels=2))
    with pytest.raises(InvalidArgument, match=r"3 labels, over the limit of 2 \(setting max_labels\)"):
        validation.labels({"a": "1", "b": "2", "c": "3"}, Limits(max_labels=2))
    with pytest.raises(InvalidArgument, match=r"over the limit of 4 bytes \(setting max_id_bytes\)"):
        validation.labels({"a": "12345"}, Limits(max_id_bytes=4))
    with pytest.raises(InvalidArgument, match="is empty"):
        validation.labels({"": "x"}, LIMITS)


# --- numbers that reach the registry -----------------------------------------------------------------


@pytest.mark.parametrize("pid", [0, 1, 4_194_304, 2**31 - 1])
def test_pids_a_process_can_have_are_accepted(pid: int) -> None:
    assert validation.pid(pid) == pid


@pytest.mark.parametrize("pid", [-1, 2**31, 2**63, 2**64, 10**400])
def test_pids_out_of_range_are_refused(pid: int) -> None:
    with pytest.raises(InvalidArgument, match=r"pid .* is out of range; .* \(0 to 2147483647\)") as refused:
        validation.pid(pid)
    assert len(refused.value.message) < 200


@pytest.mark.parametrize(("value", "ok"), [(0, True), (2**63 - 1, True), (2**63, False), (-1, False)])
def test_before_id_fits_a_signed_64_bit_column(value: int, ok: bool) -> None:
    if ok:
        assert validation.before_id(value) == value
    else:
        with pytest.raises(InvalidArgument, match="before_id .* is out of range"):
            validation.before_id(value)


# --- echoing client input --------------------------------------------------------------------------


def test_describe_cuts_long_values_and_says_how_long_they_were() -> None:
    assert validation.describe("short") == "'short'"
    shown = validation.describe("x" * 100_000)
    assert shown.startswith("'xxx") and shown.endswith("...' (100000 characters)") and len(shown) < 120
    assert validation.describe(2**200) == "<an integer of 201 bits>"
    assert validation.describe(12) == "12"


def test_refusals_echo_long_client_values_cut() -> None:
    for refuse in [
        lambda: validation.checkpoint_name("a b" * 80, LIMITS),
        lambda: validation.writer_id("a b" * 80, LIMITS),
        lambda: validation.labels({"k" * 100_000: "v"}, LIMITS),
        lambda: validation.labels({"k": "v" * 100_000}, LIMITS),
        lambda: validation.deltas([("t", "s", 2**500)], LIMITS),
    ]:
        with pytest.raises(InvalidArgument) as refused:
            refuse()
        assert len(refused.value.message) < 400, refused.value.message


def test_bounded_message_and_details_cap_what_a_transport_sends() -> None:
    assert validation.bounded_message("fine") == "fine"
    cut = validation.bounded_message("é" * 10_000)
    assert len(cut.encode()) <= validation.MAX_MESSAGE_BYTES and "message cut from 20000 bytes" in cut
    assert validation.bounded_details({"k": "v"}) == {"k": "v"}
    assert "omitted" in validation.bounded_details({"k": "v" * 10_000})


# --- checked batches -------------------------------------------------------------------------------


def test_a_checked_batch_is_not_checked_again() -> None:
    checked = validation.deltas([("t", "s", 1)], LIMITS)
    assert checked == (("t", "s", 1),)
    assert validation.deltas(checked, Limits(max_deltas_per_call=1)) is checked
    ids = validation.source_ids(["a", "b"], LIMITS)
    assert validation.source_ids(ids, LIMITS) is ids


def test_too_many_without_a_count_says_more_than_the_limit() -> None:
    limits = Limits(max_deltas_per_call=5, max_ids_per_query=7)
    assert "batch has more than 5 deltas" in validation.too_many_deltas(limits).message
    assert "query has more than 7 source ids" in validation.too_many_ids(limits).message


# --- batches: the fast check decides exactly as the item-by-item one ----------------------------


def _one_by_one(batch: list[tuple[str, str, int]]) -> str | None:
    """The reference: every item checked on its own; the refusal of the first bad one."""
    try:
        for i, (task_id, source_id, delta) in enumerate(batch):
            validation._id(f"deltas[{i}].task_id", task_id, LIMITS)
            validation._id(f"deltas[{i}].source_id", source_id, LIMITS)
            if not -(2**62) < delta < 2**62:
                raise InvalidArgument(f"deltas[{i}].delta {validation.describe(delta)} is out of range")
    except InvalidArgument as exc:
        return str(exc)
    return None


_ids = st.one_of(
    st.text(alphabet=st.characters(codec="ascii"), min_size=0, max_size=8),
    st.text(min_size=0, max_size=4),  # any code point, lone surrogates included
    st.sampled_from(["x" * 511, "x" * 512, "é" * 255, "é" * 256]),
)
_values = st.one_of(st.integers(-3, 3), st.sampled_from([2**62 - 1, 2**62, -(2**62), True]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_ids, _ids, _values), max_size=6))
def test_a_batch_is_refused_exactly_when_one_of_its_deltas_is(batch: list[tuple[str, str, int]]) -> None:
    expected = _one_by_one(batch)
    columns = [list(column) for column in zip(*batch, strict=True)] or [[], [], []]
    for check in (
        lambda: validation.deltas(batch, LIMITS),
        lambda: validation.delta_columns(*columns, LIMITS),
    ):
        if expected is None:
            assert list(check()) == batch
        else:
            with pytest.raises(InvalidArgument) as info:
                check()
            assert str(info.value).startswith(expected)


def test_plain_ids_pass_the_quick_check_and_others_go_to_the_careful_one() -> None:
    limits = Limits(max_id_bytes=8, max_ids_per_query=3)
    assert validation.plain_source_ids(["a", "s" * 8], limits) == ("a", "s" * 8)
    # None is "look closer", never a verdict: source_ids then accepts or names what is wrong.
    assert validation.plain_source_ids(["é"], limits) is None
    assert validation.source_ids(["é"], limits) == ("é",)
    for ids in (["a", ""], ["s" * 9], ["a"] * 4):
        assert validation.plain_source_ids(ids, limits) is None
