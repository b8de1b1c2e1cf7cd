"""A writer whose close() cannot deliver its buffer in time still closes on the coordinator (issue #7,
point 12): otherwise the writer id stays blocked until its lease runs out."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

import tally
from tally_server.testing import RunningServer


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def stopped(server: RunningServer) -> Iterator[None]:
    """The server process frozen (SIGSTOP) for the block: connected, but answering nothing."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def writer_states(server: RunningServer) -> dict[str, str]:
    with tally.Client(server.grpc_address, timeout=30) as client:
        return {w.writer_id: w.state for w in client.writers("cp", include_closed=True)}


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_close_that_times_out_still_closes_the_writer_on_the_coordinator(
    server: RunningServer, transport: str
) -> None:
    address = server.grpc_address if transport == "grpc" else server.http_url
    with tally.Client(address, timeout=30) as client:
        w = client.writer("cp", writer_id="w1")
        w.open()
        outcome: list[BaseException] = []

        def close() -> None:
            try:
                w.close(timeout=0.5)
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        closer = threading.Thread(target=close)
        with stopped(server):
            w.apply_deltas([("t1", "s1", 1)])
            closer.start()
            # The flush barrier cannot be met while the server is frozen: close() gives up on the
            # buffer (it counts it as dropped), then still tries to close the writer.
            wait_for(lambda: w.health().dropped == 1, "close() to give up on the buffer")
        closer.join(30)
        assert not closer.is_alive()

        assert len(outcome) == 1 and isinstance(outcome[0], tally.Unavailable), outcome
        assert "close timed out" in outcome[0].message
        assert writer_states(server)["w1"] == "closed"
        # The id is free at once, not only when the lease (30 s) runs out.
        with client.writer("cp", writer_id="w1") as again:
            again.apply_deltas([("t2", "s2", 1)])


def test_async_close_that_times_out_still_closes_the_writer_on_the_coordinator(
    server: RunningServer,
) -> None:
    async def main() -> BaseException | None:
        async with tally.AsyncClient(server.grpc_address, timeout=30) as client:
            w = client.writer("cp", writer_id="w1")
            await w.open()
            with stopped(server):
                w.apply_deltas([("t1", "s1", 1)])
                closing = asyncio.ensure_future(w.close(timeout=0.5))
                deadline = time.monotonic() + 30
                while w.health().dropped == 0:
                    assert not closing.done() and time.monotonic() < deadline, closing
                    await asyncio.sleep(0.01)
            try:
                await asyncio.wait_for(closing, 30)
            except tally.Unavailable as exc:
                return exc
            return None

    refused = asyncio.run(main())
    assert isinstance(refused, tally.Unavailable) and "close timed out" in refused.message
    assert writer_states(server)["w1"] == "closed"
