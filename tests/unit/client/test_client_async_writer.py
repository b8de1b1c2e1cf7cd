"""The asyncio AsyncWriter against the fake Transport (run in worker threads)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

import tally
from tests.unit.client.tally_fakes import FakeTransport, deltas, make_async_client, make_status

T = TypeVar("T")


def run(body: Callable[[tally.AsyncClient], Awaitable[T]], fake: FakeTransport, **overrides: object) -> T:
    """Run ``body`` with an AsyncClient over ``fake`` on a fresh event loop."""

    async def main() -> T:
        client = make_async_client(fake, **overrides)
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_async_ordering_batching_and_flush(fake: FakeTransport) -> None:
    sent = deltas(1234)

    async def body(client: tally.AsyncClient) -> None:
        async with client.writer("cp") as w:
            for i in range(0, len(sent), 50):
                w.apply_deltas(sent[i : i + 50])
            await w.flush()
            assert w.health().buffered == 0

    run(body, fake)
    assert fake.applied == sent
    assert all(len(b) <= 100 for _, b in fake.attempts)
    assert fake.calls[-2:] == ["flush", "close_writer"]


def test_async_flush_sends_no_call_when_the_last_answer_said_settled(fake: FakeTransport) -> None:
    fake.settled = True

    async def body(client: tally.AsyncClient) -> None:
        async with client.writer("cp") as w:
            w.apply_deltas(deltas(3))
            await w.flush()
            assert fake.count("flush") == 0
            fake.settled = False
            w.apply_deltas(deltas(2))
            await w.flush()
            assert fake.count("flush") == 1

    run(body, fake)
    assert fake.applied == deltas(3) + deltas(2)


def test_async_retry_resends_the_same_batch(fake: FakeTransport) -> None:
    fake.fail("apply_deltas", tally.Unavailable("reset"), tally.Unavailable("reset"))

    async def body(client: tally.AsyncClient) -> tally.WriterHealth:
        async with client.writer("cp") as w:
            w.apply_deltas(deltas(3))
            await w.flush()
            return w.health()

    health = run(body, fake)
    assert [a for a in fake.attempts] == [(1, deltas(3))] * 3
    assert fake.applied == deltas(3) and health.retries == 2


def test_async_lease_lost_on_batch(fake: FakeTransport, caplog: pytest.LogCaptureFixture) -> None:
    fake.fail("apply_deltas", tally.NotFound("unknown writer"))

    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")
        await w.open()
        w.apply_deltas(deltas(2))
        with pytest.raises(tally.LeaseLost):
            await w.flush()
        assert w.health().lease_lost
        with pytest.raises(tally.LeaseLost):
            await w.close()
        with pytest.raises(tally.LeaseLost):
            await w.close()

    with caplog.at_level(logging.ERROR, logger="tally"):
        run(body, fake)
    assert any("lost its lease" in r.getMessage() for r in caplog.records)
    assert "close_writer" not in fake.calls


def test_async_lease_lost_on_heartbeat() -> None:
    fake = FakeTransport(lease_ttl_s=0.03)
    fake.fail("keep_alive", tally.NotFound("expired"))

    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")
        await w.open()
        assert await w._wait_until(lambda: w._core.lease_lost, 10.0)
        with pytest.raises(tally.LeaseLost):
            await w.flush()
        with pytest.raises(tally.LeaseLost):
            await w.close()

    run(body, fake)


def test_async_a_heartbeat_that_crosses_its_writers_close_is_no_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeTransport(lease_ttl_s=0.03)
    beat = fake.hold("keep_alive")

    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")
        await w.open()
        await asyncio.to_thread(fake.wait_calls, "keep_alive", 1)
        fake.fail("keep_alive", tally.NotFound("writer handle 'h-1' is not open"))
        closing = fake.hold("close_writer")
        close = asyncio.ensure_future(w.close())
        await asyncio.to_thread(fake.wait_calls, "close_writer", 1)
        beat.set()  # the heartbeat's answer arrives while the close is out
        assert await w._wait_until(lambda: w._core.next_heartbeat() is None, 10.0)
        closing.set()
        result = await close
        assert result.incomplete_count == 1 and not w.health().lease_lost

    with caplog.at_level(logging.WARNING, logger="tally"):
        run(body, fake)
    assert not [r for r in caplog.records if "lease" in r.getMessage()]


def test_async_refused_batch_raises_on_flush(fake: FakeTransport) -> None:
    fake.fail("apply_deltas", tally.InvalidArgument("empty task id"))

    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")
        await w.open()
        w.apply_deltas([("", "s", 1)])
        with pytest.raises(tally.InvalidArgument, match="empty task id"):
            await w.flush()
        with pytest.raises(tally.InvalidArgument):
            await w.close()

    run(body, fake)
    assert "close_writer" in fake.calls


def test_async_apply_on_the_loop_never_blocks_it_but_never_drops(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    gate = fake.hold("apply_deltas")

    async def body(client: tally.AsyncClient) -> None:
        async with client.writer("cp") as w:
            w.apply_deltas([("first", "s", 1)])
            await asyncio.to_thread(fake.wait_calls, "apply_deltas", 1)
            w.apply_deltas(deltas(25))  # over max_buffered=10: accepted anyway
            assert w.health().buffered == 26
            gate.set()
            await w.flush()

    with caplog.at_level(logging.WARNING, logger="tally"):
        run(body, fake, max_buffered=10, max_batch=5)
    assert fake.applied == [("first", "s", 1), *deltas(25)]
    assert any("max_buffered=10" in r.getMessage() for r in caplog.records)


def test_async_apply_from_another_thread_blocks_for_room(fake: FakeTransport) -> None:
    gate = fake.hold("apply_deltas")

    async def body(client: tally.AsyncClient) -> None:
        async with client.writer("cp") as w:
            w.apply_deltas([("first", "s", 1)])
            await asyncio.to_thread(fake.wait_calls, "apply_deltas", 1)
            w.apply_deltas(deltas(10, "fill"))
            returned = threading.Event()

            def produce() -> None:
                w.apply_deltas(deltas(3, "late"))
                returned.set()

            producer = threading.Thread(target=produce)
            producer.start()
            assert await w._wait_until(lambda: w._blocked == 1, 10.0) or w._blocked == 1
            assert not returned.is_set()
            gate.set()
            await asyncio.to_thread(producer.join)
            await w.flush()

    run(body, fake, max_buffered=10, max_batch=5)
    assert fake.applied == [("first", "s", 1), *deltas(10, "fill"), *deltas(3, "late")]


def test_async_context_manager_closes_on_exception(fake: FakeTransport) -> None:
    async def body(client: tally.AsyncClient) -> tally.AsyncWriter:
        with pytest.raises(RuntimeError, match="boom"):
            async with client.writer("cp") as w:
                w.apply_deltas(deltas(2))
                raise RuntimeError("boom")
        return w

    w = run(body, fake)
    assert fake.applied == deltas(2) and fake.count("close_writer") == 1
    assert not w.health().open and not w._tasks


def test_async_close_timeout_discards_the_buffer_and_still_closes_on_the_coordinator(
    fake: FakeTransport,
) -> None:
    fake.fail("apply_deltas", *[tally.Unavailable("down")] * 100_000)

    async def body(client: tally.AsyncClient) -> tally.AsyncWriter:
        w = client.writer("cp")
        await w.open()
        w.apply_deltas(deltas(3))
        with pytest.raises(tally.Unavailable, match="close timed out"):
            await w.close(timeout=0.05)
        return w

    w = run(body, fake, retry_initial_s=0.01, retry_max_s=0.01)
    assert w.health().dropped == 3 and fake.count("close_writer") == 1


def test_async_close_idempotent_and_client_queries(fake: FakeTransport) -> None:
    fake.completed.add("b")
    fake.checkpoint_names.append("cp")

    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")
        assert await w.are_completed(["a", "b"]) == [False, True]
        await w.open()
        first = await w.close()
        assert await w.close() is first
        assert await client.are_completed("cp", ["b"]) == [True]
        assert await client.checkpoint("cp") == make_status("cp")
        assert [c.name for c in await client.checkpoints()] == ["cp"]
        with pytest.raises(tally.NotFound):
            await client.checkpoint("nope")

    run(body, fake)
    assert fake.count("close_writer") == 1 and fake.closed


def test_async_client_close_closes_open_writers(fake: FakeTransport) -> None:
    async def body(client: tally.AsyncClient) -> tally.AsyncWriter:
        w = client.writer("cp")
        await w.open()
        w.apply_deltas(deltas(3))
        await client.close()
        with pytest.raises(tally.FailedPrecondition, match="client .* is closed"):
            await client.checkpoints()
        return w

    w = run(body, fake)
    assert fake.applied == deltas(3) and fake.count("close_writer") == 1 and not w.health().open


def test_async_crashed_background_task_stops_the_writer_visibly(fake: FakeTransport) -> None:
    async def body(client: tally.AsyncClient) -> None:
        w = client.writer("cp")

        async def crash(batch: object) -> None:
            raise RuntimeError("sender bug")

        w._send = crash  # type: ignore[method-assign]
        await w.open()
        w.apply_deltas(deltas(2))
        with pytest.raises(tally.Internal, match="sender bug"):
            await w.flush()
        with pytest.raises(tally.Internal):
            await w.close()

    run(body, fake)
