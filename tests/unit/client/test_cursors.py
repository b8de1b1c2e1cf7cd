"""Cursors inside long sources: buffered by save_cursor, saved by flush()/close(), read by cursor()."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading

import pytest

import tally
from tally import Client
from tally import _calls as calls
from tally._transport import grpc_convert, http_convert
from tally.integrations.tracker import Tracker
from tally.v1 import coordinator_pb2 as pb
from tests.unit.client.tally_fakes import WAIT_S, FakeTransport, make_async_client, make_client


def test_save_cursor_buffers_until_flush_which_saves_them_in_one_call(
    client: Client, fake: FakeTransport
) -> None:
    with client.writer("cp") as w:
        w.save_cursor("a", b"row=10")
        w.save_cursor("b", bytearray(b"byte=7"))
        assert fake.count("save_cursors") == 0  # no I/O
        w.flush()
        assert fake.cursor_calls == [[("a", b"row=10"), ("b", b"byte=7")]]
        # Durable when flush returns, after the barrier's own call.
        assert fake.calls[-2:] == ["flush", "save_cursors"]
        assert fake.cursors["a"] == (b"row=10", "h-1")
        w.flush()  # nothing new: no call
        assert fake.count("save_cursors") == 1
    assert fake.count("save_cursors") == 1  # close had nothing left to save


def test_the_latest_cursor_of_a_source_wins(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp") as w:
        for row in range(5):
            w.save_cursor("a", str(row).encode())
        w.flush()
        w.save_cursor("a", b"9")
        w.flush()
    assert fake.cursor_calls == [[("a", b"4")], [("a", b"9")]]


def test_a_settled_flush_still_saves_the_cursors(client: Client, fake: FakeTransport) -> None:
    fake.settled = True
    with client.writer("cp") as w:
        w.apply_deltas([("t", "a", 1)])
        w.save_cursor("a", b"1")
        w.flush()
        assert fake.count("flush") == 0 and fake.cursor_calls == [[("a", b"1")]]


def test_close_saves_the_cursors_before_closing(client: Client, fake: FakeTransport) -> None:
    with client.writer("cp") as w:
        w.save_cursor("a", b"42")
    assert fake.calls[-2:] == ["save_cursors", "close_writer"]
    assert fake.cursors["a"][0] == b"42"
    with pytest.raises(tally.FailedPrecondition, match="closed"):
        w.save_cursor("a", b"43")


def test_an_unreachable_coordinator_keeps_the_cursors_for_the_next_flush(fake: FakeTransport) -> None:
    client = make_client(fake, retry_initial_s=0.01, retry_max_s=0.01)
    down = threading.Event()
    down.set()
    real = fake.save_cursors

    def save_cursors(*args: object) -> calls.CursorsSaved:
        if down.is_set():
            fake.calls.append("save_cursors (down)")
            raise tally.Unavailable("connection refused")
        return real(*args)  # type: ignore[arg-type]

    fake.save_cursors = save_cursors  # type: ignore[method-assign]
    with client.writer("cp") as w:
        w.save_cursor("a", b"1")
        with pytest.raises(tally.Unavailable, match="save 1 cursor of writer"):
            w.flush(timeout=0.1)
        assert fake.calls.count("save_cursors (down)") > 1  # retried within the flush's timeout
        assert w.cursor("a") == b"1" and "get_cursor" not in fake.calls  # still buffered
        w.save_cursor("b", b"2")
        down.clear()
        w.flush()
        assert fake.cursor_calls == [[("a", b"1"), ("b", b"2")]]
        w.flush()
    client.close()
    assert fake.cursor_calls == [[("a", b"1"), ("b", b"2")]]


def test_a_cursor_saved_while_the_call_is_out_stays_buffered(client: Client, fake: FakeTransport) -> None:
    gate = fake.hold("save_cursors")
    with client.writer("cp") as w:
        w.save_cursor("a", b"1")
        flusher = threading.Thread(target=w.flush)
        flusher.start()
        fake.wait_calls("save_cursors", 1)
        w.save_cursor("a", b"2")  # newer than the one on the wire
        gate.set()
        flusher.join(WAIT_S)
        assert w.cursor("a") == b"2" and "get_cursor" not in fake.calls
        w.flush()
    assert fake.cursor_calls == [[("a", b"1")], [("a", b"2")]]
    assert fake.cursors["a"][0] == b"2"


def test_refused_cursors_are_dropped_rather_than_failing_every_flush(
    client: Client, fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("save_cursors", tally.InvalidArgument("source id too long"))
    with client.writer("cp") as w:
        w.save_cursor("a", b"1")
        with caplog.at_level(logging.ERROR, logger="tally"), pytest.raises(tally.InvalidArgument):
            w.flush()
        assert any("refused 1 cursor (" in r.getMessage() for r in caplog.records)
        w.flush()
    assert fake.count("save_cursors") == 1


def test_cursors_of_completed_sources_are_not_saved(client: Client, fake: FakeTransport) -> None:
    fake.completed.add("done")
    with client.writer("cp") as w:
        w.save_cursor("done", b"1")
        w.save_cursor("open", b"2")
        w.flush()
        assert w.cursor("done") is None and w.cursor("open") == b"2"
    assert set(fake.cursors) == {"open"}


def test_cursor_values_are_checked_locally(client: Client, fake: FakeTransport) -> None:
    w = client.writer("cp")
    w.save_cursor("a", b"x" * 4096)  # the limit itself is fine
    w.save_cursor("b", memoryview(b"abc"))
    w.save_cursor("c", b"")
    with pytest.raises(ValueError, match="at most 4096 bytes"):
        w.save_cursor("a", b"x" * 4097)
    with pytest.raises(TypeError, match="encode it first"):
        w.save_cursor("a", "row=1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        w.save_cursor("a", 12)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source id"):
        w.save_cursor(3, b"1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        w.save_cursor("", b"1")
    assert w._core.cursors == {"a": b"x" * 4096, "b": b"abc", "c": b""}
    with pytest.raises(tally.InvalidArgument):
        w.cursor("")
    w.close()  # never opened: nothing is sent
    assert fake.calls == []


def test_a_buffer_copy_is_kept_not_the_callers_object(client: Client, fake: FakeTransport) -> None:
    data = bytearray(b"10")
    with client.writer("cp") as w:
        w.save_cursor("a", data)
        data[:] = b"99"
        assert w.cursor("a") == b"10"


def test_cursor_reads_the_buffer_then_the_coordinator(client: Client, fake: FakeTransport) -> None:
    fake.cursors["old"] = (b"from an earlier run", "h-0")
    with client.writer("cp/a") as w:
        assert w.cursor("never") is None
        assert w.cursor("old") == b"from an earlier run"
        assert fake.args["get_cursor"] == [("cp/a", "never"), ("cp/a", "old")]
        w.save_cursor("old", b"newer")
        assert w.cursor("old") == b"newer"  # buffered: no call
        assert fake.count("get_cursor") == 2
        w.flush()
        assert w.cursor("old") == b"newer"  # now from the coordinator
        assert fake.count("get_cursor") == 3
    assert client.cursor("cp/a", "old") == b"newer"  # no writer needed
    assert client.cursor("cp/a", "never") is None
    with pytest.raises(tally.InvalidArgument):
        client.cursor("", "a")


def test_a_new_writer_resumes_from_the_cursor_and_completion_clears_it(fake: FakeTransport) -> None:
    client = make_client(fake)
    with client.writer("cp", writer_id="run-1") as w:
        w.save_cursor("big", b"row=500")
        w.flush()
    with client.writer("cp", writer_id="run-2") as w:
        assert w.cursor("big") == b"row=500"
        fake.completed.add("big")
        assert w.cursor("big") is None
    client.close()


def test_close_timeout_and_lost_lease_drop_the_cursors_with_a_warning(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(fake)
    fake.fail("apply_deltas", tally.NotFound("unknown writer handle"))
    w = client.writer("cp")
    w.open()
    w.save_cursor("a", b"1")
    w.apply_deltas([("t", "a", 1)])
    with caplog.at_level(logging.WARNING, logger="tally"), pytest.raises(tally.LeaseLost):
        w.flush()
    assert any("1 cursor not saved (its source resumes" in r.getMessage() for r in caplog.records)
    with pytest.raises(tally.LeaseLost):
        w.close()
    client.close()
    assert fake.count("save_cursors") == 0


def test_close_that_cannot_save_the_cursors_raises_and_still_closes(fake: FakeTransport) -> None:
    client = make_client(fake, retry_initial_s=0.01, retry_max_s=0.01)
    fake.fail("save_cursors", *[tally.Unavailable("down")] * 1000)
    w = client.writer("cp")
    w.open()
    w.save_cursor("a", b"1")
    with pytest.raises(tally.Unavailable, match="save 1 cursor of writer"):
        w.close(timeout=0.1)
    assert fake.calls[-1] == "close_writer"  # the writer id is free at once
    client.close()


def test_cursor_calls_split_only_when_very_large() -> None:
    full = [(f"s{i}", b"x" * 4096) for i in range(300)]
    chunks = calls.cursor_chunks(full)
    assert [len(c) for c in chunks] == [256, 44]
    assert calls.cursor_chunks([("a", b""), ("b", b"1")]) == [[("a", b""), ("b", b"1")]]
    assert calls.cursor_chunks([]) == []


# ------------------------------------------------------------------ asyncio


def test_async_writer_cursors(fake: FakeTransport) -> None:
    fake.cursors["old"] = (b"5", "h-0")

    async def main() -> None:
        client = make_async_client(fake)
        try:
            async with client.writer("cp") as w:
                assert await w.cursor("old") == b"5"
                w.save_cursor("old", b"6")
                w.save_cursor("new", b"1")
                assert await w.cursor("old") == b"6"
                assert fake.count("save_cursors") == 0
                await w.flush()
                assert fake.cursor_calls == [[("old", b"6"), ("new", b"1")]]
                await w.flush()
                w.save_cursor("new", b"2")
            assert fake.calls[-2:] == ["save_cursors", "close_writer"]
            assert await client.cursor("cp", "new") == b"2"
            assert await client.cursor("cp", "gone") is None
        finally:
            await client.close()

    asyncio.run(main())
    assert fake.cursor_calls == [[("old", b"6"), ("new", b"1")], [("new", b"2")]]


def test_async_flush_keeps_the_cursors_when_the_coordinator_is_unreachable(fake: FakeTransport) -> None:
    fake.fail("save_cursors", *[tally.Unavailable("down")] * 1000)

    async def main() -> None:
        client = make_async_client(fake, retry_initial_s=0.01, retry_max_s=0.01)
        try:
            async with client.writer("cp") as w:
                w.save_cursor("a", b"1")
                with pytest.raises(tally.Unavailable):
                    await w.flush(timeout=0.1)
                assert await w.cursor("a") == b"1"
                fake._failures["save_cursors"].clear()
                await w.flush()
                assert fake.cursors["a"][0] == b"1"
        finally:
            await client.close()

    asyncio.run(main())


# ------------------------------------------------------------------ the tracker


def test_tracker_resumes_a_long_source_from_its_cursor(fake: FakeTransport) -> None:
    rows = list(range(10))
    written: list[int] = []

    def run(crash_after: int | None) -> None:
        with make_client(fake) as client, client.writer("etl") as writer:
            tracker = Tracker(writer)
            for source in tracker.todo(["big"]):
                task = tracker.start(source)
                start = int(tracker.cursor(source) or b"0")
                for row in rows[start:]:
                    if row == crash_after:
                        return  # the run dies here (the writer closes without the source done)
                    written.append(row)
                    tracker.save_cursor(source, str(row + 1).encode())
                    writer.flush()
                task.done()
                fake.completed.add(source)  # the fake does not count deltas

    run(crash_after=4)
    assert fake.cursors["big"][0] == b"4"
    run(crash_after=None)
    assert written == rows  # each row once: the second run resumed at row 4
    client = make_client(fake)
    assert client.cursor("etl", "big") is None  # completed: no cursor
    client.close()


def test_tracker_checks_the_source_id(fake: FakeTransport) -> None:
    client = make_client(fake)
    with client.writer("etl") as writer:
        tracker = Tracker(writer)
        with pytest.raises(ValueError, match="non-empty"):
            tracker.save_cursor("", b"1")
        with pytest.raises(ValueError, match="non-empty"):
            tracker.cursor("")
        with pytest.raises(ValueError, match="4096"):
            tracker.save_cursor("a", bytes(5000))
    client.close()


# ------------------------------------------------------------------ the wires


def test_grpc_routes_carry_cursors_as_bytes() -> None:
    save = grpc_convert.ROUTES[calls.SaveCursors]
    request = save.request(calls.SaveCursors("h", [("a", b"\x00\xff"), ("b", b"")]))
    assert request == pb.SaveCursorsRequest(
        handle="h", cursors=[pb.Cursor(source_id="a", data=b"\x00\xff"), pb.Cursor(source_id="b")]
    )
    assert save.read(pb.SaveCursorsResponse(saved=1, completed=1)) == calls.CursorsSaved(1, 1)
    get = grpc_convert.ROUTES[calls.GetCursor]
    assert get.request(calls.GetCursor("cp", "a")) == pb.GetCursorRequest(checkpoint="cp", source_id="a")
    assert get.read(pb.GetCursorResponse(found=False)) is None
    found = pb.GetCursorResponse(found=True, data=b"", saved_at=2.5, writer_id="w")
    assert get.read(found) == calls.SavedCursor(b"", 2.5, "w")  # an empty cursor is still a cursor


def test_http_routes_carry_cursors_as_base64() -> None:
    save = http_convert.ROUTES[calls.SaveCursors]
    call = calls.SaveCursors("h/1", [("a", b"\x00\xff"), ("b", b"")])
    assert (save.method, save.path(call)) == ("POST", "/v1/writers/h%2F1/cursors")
    assert save.body(call) == {
        "cursors": [
            {"source_id": "a", "data": base64.b64encode(b"\x00\xff").decode()},
            {"source_id": "b", "data": ""},
        ]
    }
    assert save.read({"saved": 1, "completed": 1}) == calls.CursorsSaved(1, 1)
    get = http_convert.ROUTES[calls.GetCursor]
    assert (get.method, get.path(calls.GetCursor("cp/a", "s 1"))) == (
        "GET",
        "/v1/cursors?checkpoint=cp%2Fa&source_id=s+1",
    )
    assert get.read({"found": False, "data": "", "saved_at": 0.0, "writer_id": ""}) is None
    assert get.read({"found": True, "data": "AP8=", "saved_at": 2.5, "writer_id": "w"}) == calls.SavedCursor(
        b"\x00\xff", 2.5, "w"
    )
    assert get.read({"found": True, "data": ""}) == calls.SavedCursor(b"")
    for malformed in ({"found": True, "data": "not base64!"}, {"found": True, "data": 7}):
        with pytest.raises((TypeError, ValueError)):
            get.read(malformed)
