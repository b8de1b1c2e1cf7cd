"""An address listing several coordinators, against real ``tally serve`` processes.

Clients are pinned to start on the first address listed (``first_replica``), the one that is down,
so every test goes through a move; a random start would skip it half the time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import tally
from tally._transport import failover
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import nemo_read, tree

LOGGER = "tally._transport.failover"
WIRES = ["grpc", "http"]
FLAVOURS = ["sync", "async"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("live"), settle_ms=0) as srv:
        yield srv


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port bound by this test and never listened on: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture(autouse=True)
def start_on_the_first_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "first_replica", lambda count: 0)


def url(wire: str, server: RunningServer) -> str:
    return f"grpc://{server.grpc_address}" if wire == "grpc" else server.http_url


def moves(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def write_one_source(client: tally.Client, checkpoint: str) -> tally.CloseResult:
    """The writer's first call goes to the first address: open, apply, flush, close."""
    with client.writer(checkpoint, writer_id="w") as writer:
        writer.apply_deltas(tree("x"))
        writer.apply_deltas(tree("y")[:2])
        writer.flush()
        assert writer.are_completed(["x", "y"]) == [True, False]
    return writer.close()


async def async_write_one_source(client: tally.AsyncClient, checkpoint: str) -> tally.CloseResult:
    async with client.writer(checkpoint, writer_id="w") as writer:
        writer.apply_deltas(tree("x"))
        writer.apply_deltas(tree("y")[:2])
        await writer.flush()
        assert await writer.are_completed(["x", "y"]) == [True, False]
    return await writer.close()


def checkpoint_dir(server: RunningServer, checkpoint: str) -> Path:
    return server.data_dir / "checkpoints" / checkpoint


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("wire", WIRES)
def test_a_dead_address_first_still_gets_answers(
    live: RunningServer, dead_port: int, wire: str, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"{wire}://127.0.0.1:{dead_port}"
    address = f"{dead}, {url(wire, live)}"
    checkpoint = f"multi/{wire}-{flavour}"

    # A fresh client for each operation, so that each one is the first call of its client and
    # meets the dead address itself.
    def run_sync() -> tuple[tally.CloseResult, list[bool], int]:
        with tally.Client(address) as client:
            closed = write_one_source(client, checkpoint)
        with tally.Client(address) as client:
            done = client.are_completed(checkpoint, ["x", "y", "z"])
        with tally.Client(address) as client:
            count = client.checkpoint(checkpoint).completed_count
        return closed, done, count

    async def run_async() -> tuple[tally.CloseResult, list[bool], int]:
        async with tally.AsyncClient(address) as client:
            closed = await async_write_one_source(client, checkpoint)
        async with tally.AsyncClient(address) as client:
            done = await client.are_completed(checkpoint, ["x", "y", "z"])
        async with tally.AsyncClient(address) as client:
            count = (await client.checkpoint(checkpoint)).completed_count
        return closed, done, count

    with caplog.at_level(logging.INFO, LOGGER):
        closed, done, count = run_sync() if flavour == "sync" else asyncio.run(run_async())
    assert closed.incomplete_sources == ("y",)
    assert done == [True, False, False]
    assert count == 1
    assert nemo_read(checkpoint_dir(live, checkpoint)) == {"x"}
    # Each client met the dead address once: the writer's client and the status client moved on
    # from it; reads go round the replicas by themselves and pass a silent one by for a while, so
    # the writer's read and the read client each said so instead.
    move = f"tally coordinator {dead} is unavailable, moving to {url(wire, live)}: "
    read = f"tally coordinator {dead} did not answer a read, reads pass it by for 5 s: "
    seen = [m[: len(move)] if "moving" in m else m[: len(read)] for m in moves(caplog)]
    assert seen == [move, read, read, move], moves(caplog)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("wire", WIRES)
def test_a_writer_keeps_working_when_the_first_server_stops(
    live: RunningServer, tmp_path: Path, wire: str, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Two independent coordinators: A answers the client's first call, then stops before the
    # writer's first call, which must end up on B.
    checkpoint = f"stopped/{wire}-{flavour}"
    with running_server(tmp_path / "a", settle_ms=0) as server_a:
        a, b = url(wire, server_a), url(wire, live)
        address = f"{a},{b}"

        def run_sync() -> tuple[list[bool], tally.CloseResult, int]:
            with tally.Client(address) as client:
                before = client.are_completed(checkpoint, ["x"])  # answered by A
                assert server_a.terminate() == 0
                closed = write_one_source(client, checkpoint)
                return before, closed, client.checkpoint(checkpoint).completed_count

        async def run_async() -> tuple[list[bool], tally.CloseResult, int]:
            async with tally.AsyncClient(address) as client:
                before = await client.are_completed(checkpoint, ["x"])
                assert await asyncio.to_thread(server_a.terminate) == 0
                closed = await async_write_one_source(client, checkpoint)
                return before, closed, (await client.checkpoint(checkpoint)).completed_count

        with caplog.at_level(logging.INFO, LOGGER):
            before, closed, count = run_sync() if flavour == "sync" else asyncio.run(run_async())
    assert before == [False]
    assert closed.incomplete_sources == ("y",)
    assert count == 1
    assert nemo_read(checkpoint_dir(live, checkpoint)) == {"x"}
    assert not checkpoint_dir(server_a, checkpoint).exists()
    [move] = moves(caplog)
    assert move.startswith(f"tally coordinator {a} is unavailable, moving to {b}: "), move


@pytest.mark.parametrize("wire", WIRES)
def test_a_random_start_reaches_the_live_server_either_way(
    live: RunningServer, dead_port: int, wire: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the real random start
    address = f"{wire}://127.0.0.1:{dead_port},{url(wire, live)}"
    for _ in range(4):
        with tally.Client(address) as client:
            assert client.are_completed("multi/random", ["x"]) == [False]
