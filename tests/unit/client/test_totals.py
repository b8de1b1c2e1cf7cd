"""Declared totals in the SDK: declare (chunked), remaining (paged), writer(expected_sources=),
CheckpointStatus.percent."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import tally
from tally import Client
from tally import _calls as calls
from tests.unit.client.tally_fakes import FakeTransport, make_async_client, make_status


def test_declare_ids_chunks_big_declarations_and_answers_the_total(
    client: Client, fake: FakeTransport
) -> None:
    ids = [f"s{i:05d}" for i in range(calls.DECLARE_CHUNK * 2 + 5)]
    assert client.declare("cp", ids + ids[:10]) == len(ids)  # duplicates dropped before sending
    sent = fake.args["declare_sources"]
    assert [len(ids_) for _, ids_, _ in sent if isinstance(ids_, tuple)] == [
        calls.DECLARE_CHUNK,
        calls.DECLARE_CHUNK,
        5,
    ]
    assert all(cp == "cp" and count == 0 for cp, _, count in sent)
    assert client.declare("cp", ids[:3]) == len(ids)  # idempotent


def test_declare_a_count_is_one_call(client: Client, fake: FakeTransport) -> None:
    assert client.declare("cp", count=500) == 500
    assert fake.args["declare_sources"] == [("cp", (), 500)]


@pytest.mark.parametrize(
    ("ids", "count", "match"),
    [
        (None, None, "not both"),
        (["a"], 3, "not both"),
        ("abc", None, "single str"),
        (["a", ""], None, "non-empty"),
        ([1], None, "non-empty"),
        (None, -1, "0 or more"),
        (None, True, "count"),
    ],
)
def test_bad_declarations_are_refused_before_any_call(
    client: Client, fake: FakeTransport, ids: object, count: object, match: str
) -> None:
    with pytest.raises(tally.InvalidArgument, match=match):
        client.declare("cp", ids, count=count)  # type: ignore[arg-type]
    assert fake.calls == []


def test_remaining_pages_through_declared_sources_not_completed(client: Client, fake: FakeTransport) -> None:
    fake.declared = {f"s{i}" for i in range(7)}
    fake.completed = {"s1", "s4"}
    assert list(client.remaining("cp", page_size=2)) == ["s0", "s2", "s3", "s5", "s6"]
    assert [a for _, a, _ in fake.args["list_remaining"]] == ["", "s2", "s5"]
    assert all(limit == 2 for _, _, limit in fake.args["list_remaining"])
    with pytest.raises(tally.InvalidArgument):
        client.remaining("cp", page_size=0)


def test_writer_expected_sources_declares_before_opening(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp", max_attempts=2, expected_sources=["a", "b", "a"]):
        pass
    assert fake.calls[:3] == ["set_failure_budget", "declare_sources", "open_writer"]
    assert fake.args["declare_sources"] == [("cp", ("a", "b"), 0)]
    assert "expected_sources" not in repr(fake.specs[0])  # a million ids stay out of logs
    with client.writer("cp", expected_sources=12):
        pass
    assert fake.args["declare_sources"][-1] == ("cp", (), 12)
    with client.writer("cp"):
        pass
    assert fake.count("declare_sources") == 2


def test_a_refused_declaration_opens_no_writer_and_bad_ones_fail_early(
    client: Client, fake: FakeTransport
) -> None:
    fake.fail("declare_sources", tally.PermissionDenied("reader token"))
    w = client.writer("cp", expected_sources=["a"])
    with pytest.raises(tally.PermissionDenied):
        w.open()
    assert fake.count("open_writer") == 0
    with pytest.raises(tally.InvalidArgument):
        client.writer("cp", expected_sources="abc")
    with pytest.raises(tally.InvalidArgument):
        client.writer("cp", expected_sources=-3)


def test_async_declare_remaining_and_writer() -> None:
    fake = FakeTransport()

    async def main() -> tuple[int, list[str]]:
        async with make_async_client(fake) as client:
            total = await client.declare("cp", ["a", "b", "c"])
            fake.completed = {"b"}
            left = [sid async for sid in client.remaining("cp")]
            async with client.writer("cp", expected_sources=4):
                pass
            return total, left

    assert asyncio.run(main()) == (3, ["a", "c"])
    assert fake.args["declare_sources"][-1] == ("cp", (), 4)
    assert fake.calls.index("declare_sources") < fake.calls.index("open_writer")


def test_percent_only_with_a_total() -> None:
    status = make_status("cp", completed=30)
    assert status.percent is None
    assert dataclasses.replace(status, total=120, remaining=90).percent == 25.0
    # Completions of sources never declared can exceed the total: capped.
    assert dataclasses.replace(status, total=20).percent == 100.0


def test_a_writer_declares_on_its_checkpoint(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp") as w:
        assert w.declare(["a", "b"]) == 2
        assert w.declare(count=5) == 5
        with pytest.raises(tally.InvalidArgument):
            w.declare()
    assert fake.args["declare_sources"] == [("cp", ("a", "b"), 0), ("cp", (), 5)]

    async def main() -> int:
        async with make_async_client(fake) as aclient, aclient.writer("cp") as aw:
            return await aw.declare(["c"])

    assert asyncio.run(main()) == 5
