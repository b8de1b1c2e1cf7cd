"""The generic tracker carries a pipeline through a coordinator restart (issue 9)."""

from __future__ import annotations

from pathlib import Path

import tally
from tally.integrations.tracker import Tracker
from tally_server.testing import running_server

SOURCES = [f"part-{i}" for i in range(6)]


def test_a_tracked_pipeline_carries_on_through_a_coordinator_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_server(data, settle_ms=0) as first:
        ports = {"grpc_listen": first.grpc_address, "http_listen": first.http_address}
        client = tally.Client(first.grpc_address, timeout=30)
        writer = client.writer("tracker/restart", writer_id="pipeline")
        writer.open()
        tracker = Tracker(writer)
        assert tracker.todo(SOURCES) == SOURCES
        for source in SOURCES[:2]:  # two sources done before the crash
            for part in tracker.start(source).split(2):
                part.then().done()
        # A third one is half way: split, one branch written, the other still in flight.
        halfway = tracker.start(SOURCES[2]).split(2)
        halfway[0].done()
        writer.flush()
        first.kill()
        with running_server(data, settle_ms=0, **ports) as second:
            halfway[1].then().done()  # the rest of the in-flight source, after the restart
            for source in SOURCES[3:]:
                first_part, *others = tracker.start(source).split(3)
                first_part.drop()  # filtered
                for part in others:
                    part.done()
            writer.flush()
            assert writer.close().incomplete_count == 0
            client.close()
            with tally.Client(second.grpc_address) as again:
                assert again.are_completed("tracker/restart", SOURCES) == [True] * len(SOURCES)
                rerun = again.writer("tracker/restart", writer_id="rerun")
                with rerun:
                    assert Tracker(rerun).todo(SOURCES) == []  # nothing replays
