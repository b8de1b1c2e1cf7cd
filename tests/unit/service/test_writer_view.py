"""A live writer's view, made straight from its session, is what its registry row's view would be."""

from __future__ import annotations

import dataclasses

import pytest

from tally_server.domain.checkpoint import WriterState
from tally_server.domain.ledger import WriterLedger
from tally_server.service.sessions import Session
from tally_server.service.views import WriterView


@pytest.mark.anyio
async def test_a_live_writers_view_is_its_records_view_and_a_snapshot_of_its_counters() -> None:
    # (async: a Session's lock and condition need a running loop)
    session = Session(
        handle="h-1",
        writer_id="w-1",
        checkpoint="cp/1",
        host="node-7",
        pid=4242,
        labels={"slurm_array_job_id": "12", "slurm_array_task_id": "3"},
        fingerprint={"input": "abc"},
        opened_at=100.25,
        last_seen_at=130.5,
        lease_deadline=0.0,
        ledger=WriterLedger(lambda source: source == "done-before", settle_s=0.0),
    )
    # One source completed, one in flight, one anomaly (completed before the writer opened), one
    # delta skipped (a task applied again).
    session.ledger.apply(
        [("t1", "a", 1), ("t2", "a", -1), ("t3", "b", 2), ("t4", "done-before", 1), ("t3", "b", 2)], now=1.0
    )
    session.state = WriterState.OPEN
    view = WriterView.of_live(session)
    assert view == WriterView.of(session.record())
    assert dataclasses.astuple(view.counts) != (0, 0, 0, 0, 0)
    assert view.pending_sources == session.ledger.in_flight > 0
    # Later work changes the writer, not the view already made.
    session.ledger.apply([("t5", "c", 1)], now=2.0)
    session.last_seen_at = 140.0
    assert view != WriterView.of_live(session)
    assert view.counts.applied == WriterView.of(session.record()).counts.applied - 1
