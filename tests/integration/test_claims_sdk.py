"""Claims through the SDK, the generic tracker and the NeMo Curator drop-in, against a real
``tally serve``: ``Writer.acquire`` answers per source, another writer's deltas for a held source are
refused and counted in its health, ``Client.token_is_current`` fences, and two overlapping runs split
their sources instead of both doing them."""

from __future__ import annotations

import asyncio
import logging

import pytest

import tally
from tally.integrations.nemo_curator import TallyResumabilityProxy
from tally.integrations.tracker import Tracker
from tally_server.testing import RunningServer
from tests.integration.workload import tree


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_acquire_refusals_and_fencing_through_the_sdk(server: RunningServer, wire: str) -> None:
    address = server.grpc_url if wire == "grpc" else server.http_url
    cp = f"claims-sdk/{wire}"
    with (
        tally.Client(address) as client,
        client.writer(cp, writer_id="a") as a,
        client.writer(cp, writer_id="b") as b,
    ):
        got = a.acquire(["s1", "s2", "s1"])
        assert list(got) == ["s1", "s2"]
        assert all(c.acquired and c.token == 1 for c in got.values())
        held = b.acquire(iter(["s2", "s3"]))
        assert (held["s2"].state, held["s2"].holder, held["s2"].acquired) == ("held", "a", False)
        assert held["s3"].acquired
        assert client.token_is_current(cp, "s2", 1) is True
        assert client.token_is_current(cp, "s2", 2) is False
        assert client.checkpoint(cp).claimed_sources == 3

        b.apply_deltas(tree("s2"))  # held by "a": refused, never applied
        b.flush()
        assert b.health().refused == len(tree("s2"))
        assert client.are_completed(cp, ["s2"]) == [False]

        a.apply_deltas(tree("s2"))
        a.flush()
        assert a.health().refused == 0
        assert client.are_completed(cp, ["s2"]) == [True]
        assert b.acquire(["s2"])["s2"].state == "completed"
        assert client.token_is_current(cp, "s2", 1) is False  # completed: the claim ended

        with pytest.raises(tally.InvalidArgument, match="a list of source ids"):
            a.acquire("s1")  # type: ignore[arg-type]
        with pytest.raises(tally.InvalidArgument, match=r"source_ids\[1\]"):
            a.acquire(["s1", ""])
        with pytest.raises(tally.InvalidArgument, match="token must be an integer"):
            client.token_is_current(cp, "s1", "1")  # type: ignore[arg-type]
        with pytest.raises(tally.NotFound):
            client.token_is_current("claims-sdk/none", "s1", 1)
    # Both writers closed: every claim ended.
    with tally.Client(address) as client:
        assert client.token_is_current(cp, "s1", 1) is False
        assert client.token_is_current(cp, "s3", 1) is False
        assert client.checkpoint(cp).claimed_sources == 0


def test_the_async_writer_acquires_too(server: RunningServer) -> None:
    async def run() -> None:
        async with tally.AsyncClient(server.grpc_url) as client:
            async with client.writer("claims-sdk/async", writer_id="x") as w:
                claims = await w.acquire(["p", "q"])
                assert [c.token for c in claims.values()] == [1, 1]
                assert await client.token_is_current("claims-sdk/async", "q", 1) is True
            assert await client.token_is_current("claims-sdk/async", "q", 1) is False

    asyncio.run(run())


def test_two_overlapping_tracked_runs_split_the_sources(server: RunningServer) -> None:
    sources = [f"part-{i}" for i in range(6)]
    done: list[tuple[str, str]] = []
    with tally.Client(server.grpc_url) as client:
        first = client.writer("claims-sdk/tracker", writer_id="first")
        second = client.writer("claims-sdk/tracker", writer_id="second")
        with first, second:
            one, two = Tracker(first), Tracker(second)
            mine, theirs = one.claim(one.todo(sources)), two.claim(two.todo(sources))
            # The two runs take turns; each source is claimed just before it is worked on.
            for run, tracker, it in [("first", one, mine), ("second", two, theirs)] * 3:
                source = next(it)
                tracker.start(source)  # begun, not finished: the claim stays
                done.append((run, source))
            # Neither completed anything yet: the rest of the sources are all held.
            assert list(mine) == [] and list(theirs) == []
        claimed = sorted(source for _, source in done)
        assert claimed == sources  # each source went to exactly one of the two runs
        assert {run for run, _ in done} == {"first", "second"}


def test_the_nemo_drop_in_skips_partitions_another_live_run_holds(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    partitions = [f"file_group_{i}" for i in range(5)]
    caplog.set_level(logging.WARNING)
    first = TallyResumabilityProxy(server.grpc_url, "claims-sdk/nemo", writer_id="job-1", claims=True)
    second = TallyResumabilityProxy(server.grpc_url, "claims-sdk/nemo", writer_id="job-2", claims=True)
    plain = TallyResumabilityProxy(server.grpc_url, "claims-sdk/nemo", writer_id="job-3")
    try:
        assert first.are_completed(partitions[:3]) == [False] * 3
        assert second.are_completed(partitions) == [True, True, True, False, False]
        assert "skipping 3 partitions other live writers hold" in caplog.text
        assert plain.are_completed(partitions) == [False] * 5  # without claims: NeMo's own rule
        first.apply_deltas(tree(partitions[0]))
    finally:
        first.close()
    third = TallyResumabilityProxy(server.grpc_url, "claims-sdk/nemo", writer_id="job-4", claims=True)
    try:
        # The first run ended: its completed partition is skipped, the two it left are free again.
        assert third.are_completed(partitions) == [True, False, False, True, True]
    finally:
        third.close()
        second.close()
        plain.close()
