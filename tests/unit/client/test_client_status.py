"""Status and admin methods of Client / AsyncClient over the fake transport: paging, chunking,
retries, watch reconnects and argument checks (the wire itself is tested per transport)."""

from __future__ import annotations

import asyncio

import pytest

import tally
from tally import Client
from tally._client import IMPORT_CHUNK
from tests.unit.client.tally_fakes import (
    FakeTransport,
    make_async_client,
    make_client,
    make_status,
    make_writer,
)


def test_writers_events_progress_pass_their_arguments(client: Client, fake: FakeTransport) -> None:
    assert [w.writer_id for w in client.writers("cp")] == ["w0", "w1"]
    assert [w.writer_id for w in client.writers("cp", include_closed=True, limit=1)] == ["w0"]
    page = client.events("cp", limit=4)
    assert [e.id for e in page.events] == [10, 9, 8, 7] and page.next_before_id == 7
    older = client.events("cp", limit=4, before_id=page.next_before_id)
    assert [e.id for e in older.events] == [6, 5, 4, 3] and older.events[0].data == {"n": 6}
    last = client.events("cp", limit=10, before_id=3)
    assert [e.id for e in last.events] == [2, 1] and last.next_before_id is None
    assert client.progress("cp", since=1.5) == [tally.ProgressSample(1.0, 1), tally.ProgressSample(2.0, 3)]
    assert client.progress("cp")[1].completed_count == 3
    assert fake.args["list_writers"] == [("cp", False, 100, ""), ("cp", True, 1, "")]
    assert fake.args["list_events"] == [("cp", 4, None), ("cp", 4, 7), ("cp", 10, 3)]
    assert fake.args["get_progress"] == [("cp", 1.5), ("cp", None)]


def test_status_calls_retry_when_unavailable(client: Client, fake: FakeTransport) -> None:
    fake.fail("list_writers", tally.Unavailable("down"), tally.Unavailable("still down"))
    assert len(client.writers("cp")) == 2
    assert fake.count("list_writers") == 3
    fake.fail("list_events", tally.NotFound("checkpoint 'cp' does not exist"))
    with pytest.raises(tally.NotFound, match="does not exist"):
        client.events("cp")
    assert fake.count("list_events") == 1  # only Unavailable is retried


def test_completed_pages_through_every_id(client: Client, fake: FakeTransport) -> None:
    fake.completed = {f"s{i:03d}" for i in range(25)}
    ids = client.completed("cp", page_size=10)
    assert fake.count("list_completed") == 0  # lazy: nothing fetched before iteration
    assert list(ids) == sorted(fake.completed)
    assert [after for _, after, _ in fake.args["list_completed"]] == ["", "s009", "s019"]
    assert {limit for _, _, limit in fake.args["list_completed"]} == {10}


def test_checkpoints_and_writers_follow_every_page(client: Client, fake: FakeTransport) -> None:
    fake.checkpoint_names = [f"cp{i:02d}" for i in range(7)]
    assert [c.name for c in client.checkpoints(page_size=3)] == fake.checkpoint_names
    assert fake.args["list_checkpoints"] == [("", 3), ("cp02", 3), ("cp05", 3)]
    fake.writer_ids = [f"w{i}" for i in range(5)]
    assert [w.writer_id for w in client.writers("cp", limit=None, page_size=2)] == fake.writer_ids
    assert [after for *_, after in fake.args["list_writers"]] == ["", "live/w1", "live/w3"]
    # limit caps the total; the last page asks only for what is still wanted.
    fake.args["list_writers"].clear()
    assert [w.writer_id for w in client.writers("cp", limit=3, page_size=2)] == ["w0", "w1", "w2"]
    assert [(limit, after) for _, _, limit, after in fake.args["list_writers"]] == [(2, ""), (1, "live/w1")]
    with pytest.raises(tally.InvalidArgument, match="page_size must be a positive integer"):
        client.writers("cp", page_size=0)
    with pytest.raises(tally.InvalidArgument, match="page_size must be a positive integer"):
        client.checkpoints(page_size=0)


def test_writers_keep_the_first_listing_of_a_writer_seen_twice(client: Client, fake: FakeTransport) -> None:
    """A writer that ended between two pages comes again among the ended ones: listed once."""
    pages = iter(
        [
            tally._types.WriterPage((make_writer("w0"), make_writer("w1")), "live/w1"),
            tally._types.WriterPage((make_writer("w1"), make_writer("w2")), ""),
        ]
    )
    fake.list_writers = lambda *args: next(pages)  # type: ignore[method-assign]
    assert [w.writer_id for w in client.writers("cp", include_closed=True, limit=None)] == ["w0", "w1", "w2"]


def test_completed_of_an_empty_checkpoint_is_empty(client: Client, fake: FakeTransport) -> None:
    assert list(client.completed("cp")) == []
    assert fake.count("list_completed") == 1


def test_completed_refuses_a_cursor_that_goes_backwards(client: Client, fake: FakeTransport) -> None:
    fake.list_completed = lambda cp, after, limit, timeout: tally._types.CompletedPage(("a",), "a")  # type: ignore[method-assign]
    with pytest.raises(tally.Internal, match="cursor went backwards"):
        list(client.completed("cp"))


def test_import_dedupes_chunks_and_adds_up(client: Client, fake: FakeTransport) -> None:
    fake.completed = {"id-0"}
    ids = [f"id-{i}" for i in range(IMPORT_CHUNK + 10)] + ["id-1", "id-2"]  # duplicates at the end
    result = client.import_completed("cp", ids, import_id="imported-1")
    assert result == tally.ImportResult(imported=IMPORT_CHUNK + 9, completed_count=IMPORT_CHUNK + 10)
    calls = fake.args["import_completed"]
    assert [len(batch) for _, batch, _ in calls] == [IMPORT_CHUNK, 10]
    assert {import_id for _, _, import_id in calls} == {"imported-1"}
    assert calls[0][1][:3] == ["id-0", "id-1", "id-2"]  # order kept


def test_import_of_nothing_still_reports_the_count(client: Client, fake: FakeTransport) -> None:
    fake.completed = {"a", "b"}
    assert client.import_completed("cp", [], import_id="x") == tally.ImportResult(0, 2)


def test_import_retries_a_chunk_that_got_no_answer(client: Client, fake: FakeTransport) -> None:
    fake.fail("import_completed", tally.Unavailable("blip"))
    assert client.import_completed("cp", ["a"], import_id="x").completed_count == 1
    assert fake.count("import_completed") == 2


def test_reset_is_not_retried(client: Client, fake: FakeTransport) -> None:
    assert client.reset("cp", force=True) == tally.ResetResult(".trash/cp/t", 2, 1)
    fake.fail("reset_checkpoint", tally.Unavailable("connection reset"))
    with pytest.raises(tally.Unavailable, match="may or may not have happened"):
        client.reset("cp")
    assert fake.count("reset_checkpoint") == 2
    fake.fail("reset_checkpoint", tally.FailedPrecondition("checkpoint 'cp' has 1 live writer"))
    with pytest.raises(tally.FailedPrecondition, match="1 live writer"):
        client.reset("cp")
    assert fake.args["reset_checkpoint"] == [("cp", True), ("cp", False), ("cp", False)]


def test_watch_yields_and_reconnects(client: Client, fake: FakeTransport) -> None:
    fake.watch_script.extend(
        [
            [make_status("cp", 1), tally.Unavailable("stream broke")],
            [],  # the server ended the stream without a word
            [make_status("cp", 2), make_status("cp", 3)],
        ]
    )
    stream = client.watch("cp", interval_s=0.25)
    assert [next(stream).completed_count for _ in range(3)] == [1, 2, 3]
    stream.close()  # type: ignore[attr-defined]
    assert fake.args["watch"] == [("cp", 250)] * 3
    assert fake.watch_closed == 3


def test_watch_gives_up_after_the_timeout(fake: FakeTransport) -> None:
    fake.watch_script.extend([[tally.Unavailable(f"down {i}")] for i in range(1000)])
    client = make_client(fake, timeout=0.2, retry_initial_s=0.01, retry_max_s=0.01)
    with client, pytest.raises(tally.Unavailable, match=r"watch 'cp': no answer within 0\.2s.*down"):
        next(client.watch("cp"))


def test_watch_passes_refusals_through(client: Client, fake: FakeTransport) -> None:
    fake.watch_script.append([tally.NotFound("checkpoint 'nope' does not exist")])
    with pytest.raises(tally.NotFound):
        next(client.watch("nope"))
    assert fake.count("watch") == 1


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.writers(""), "checkpoint must be a non-empty string"),
        (lambda c: c.writers("cp", limit=0), "limit must be a positive integer"),
        (lambda c: c.events("cp", before_id=0), "before_id must be a positive integer"),
        (lambda c: c.events("cp", limit=True), "limit must be a positive integer"),
        (lambda c: c.progress("cp", since="yesterday"), "since must be seconds"),
        (lambda c: c.completed("cp", page_size=0), "page_size must be a positive integer"),
        (lambda c: c.import_completed("cp", "abc", import_id="x"), "not a single str"),
        (lambda c: c.import_completed("cp", [1], import_id="x"), "source ids are strings"),
        (lambda c: c.are_completed("cp", ["a"] * 25_000 + [b"b"]), r"source_ids\[25000\] is bytes b'b'"),
        (lambda c: c.import_completed("cp", ["a"], import_id=""), "import_id must be a non-empty string"),
        (lambda c: c.reset(None), "checkpoint must be a non-empty string"),
        (lambda c: c.watch("cp", interval_s=0), "interval_s must be a positive number"),
    ],
)
def test_bad_arguments_are_refused_locally(client: Client, fake: FakeTransport, call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(tally.InvalidArgument, match=match):
        call(client)
    assert not [c for c in fake.calls if c != "close"]


def test_closed_client_refuses(fake: FakeTransport) -> None:
    client = make_client(fake)
    client.close()
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        client.writers("cp")


def test_async_client_has_the_same_behaviour(fake: FakeTransport) -> None:
    fake.completed = {f"s{i}" for i in range(7)}
    fake.watch_script.extend([[make_status("cp", 1), tally.Unavailable("broke")], [make_status("cp", 2)]])

    async def main() -> None:
        async with make_async_client(fake) as client:
            assert len(await client.writers("cp", include_closed=True)) == 2
            assert (await client.events("cp", limit=2)).next_before_id == 9
            assert len(await client.progress("cp")) == 2
            assert [s async for s in client.completed("cp", page_size=3)] == sorted(fake.completed)
            result = await client.import_completed("cp", ["s1", "new"], import_id="imp")
            assert result == tally.ImportResult(1, 8)
            assert (await client.reset("cp")).files_moved == 2
            fake.fail("reset_checkpoint", tally.Unavailable("gone"))
            with pytest.raises(tally.Unavailable, match="may or may not"):
                await client.reset("cp")
            seen = []
            async for status in client.watch("cp", interval_s=0.1):
                seen.append(status.completed_count)
                if len(seen) == 2:
                    break
            assert seen == [1, 2]
            with pytest.raises(tally.InvalidArgument):
                client.completed("cp", page_size=-1)

    asyncio.run(main())
    assert fake.args["watch"] == [("cp", 100)] * 2
    assert [after for _, after, _ in fake.args["list_completed"]] == ["", "s2", "s5"]
