"""tally.AsyncClient against a real server: the same outcomes as the sync client."""

from __future__ import annotations

import asyncio

import pytest

import tally
from tally_server.testing import RunningServer
from tests.integration.workload import nemo_read, tree


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_async_writer_completes_and_sees_live_completions(server: RunningServer, scheme: str) -> None:
    address = f"grpc://{server.grpc_address}" if scheme == "grpc" else server.http_url
    checkpoint = f"async/{scheme}"

    async def run() -> tuple[list[bool], list[bool], int, tuple[str, ...]]:
        async with tally.AsyncClient(address) as client:
            w0, w1 = client.writer(checkpoint, writer_id="a0"), client.writer(checkpoint, writer_id="a1")
            async with w0, w1:
                before = await w1.are_completed(["x", "y"])
                w0.apply_deltas(tree("x"))
                w0.apply_deltas(tree("y")[:2])
                await w0.flush()
                seen = await w1.are_completed(["x", "y"])
            closed = await w0.close()
            status = await client.checkpoint(checkpoint)
            return before, seen, status.completed_count, closed.incomplete_sources

    before, seen, completed, incomplete = asyncio.run(run())
    assert before == [False, False]
    assert seen == [True, False]
    assert completed == 1
    assert incomplete == ("y",)
    assert nemo_read(server.data_dir / "checkpoints" / "async" / scheme) == {"x"}
