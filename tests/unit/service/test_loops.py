"""Background loops and the registry's write-behind, without sleeping: steps are driven by hand."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from tally_server.domain.ports import EventRecord, ProgressRecord, WriterRecord
from tally_server.errors import Unavailable
from tally_server.service.loops import Loop
from tally_server.service.registry_writer import RegistryWriter
from tally_server.store.registry import SqlRegistry, default_sqlite_url


def test_a_failing_step_is_logged_once_per_cause_counted_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes: list[Exception | None] = [ValueError("disk"), ValueError("disk"), KeyError("x"), None, None]
    ran = []

    async def step() -> None:
        ran.append(1)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    loop = Loop("test", step, 1.0)

    async def drive() -> list[str | None]:
        seen = []
        for _ in range(5):
            await loop.run_once()
            seen.append(loop.failing)
        return seen

    with caplog.at_level(logging.WARNING, logger="tally_server.service.loops"):
        seen = asyncio.run(drive())
    assert len(ran) == 5  # it never stopped
    assert seen == ["ValueError: disk", "ValueError: disk", "KeyError: 'x'", None, None]
    assert loop.errors == 3
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert [str(r.exc_info[1]) for r in tracebacks if r.exc_info] == ["disk", "'x'"]  # once per cause
    assert any("works again after 3 failures" in r.getMessage() for r in caplog.records)


def test_a_cancelled_loop_stops() -> None:
    async def step() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(Loop("test", step, 1.0).run_once())


class BrokenRegistry(SqlRegistry):
    """The real SQLite registry, whose batch writes fail while ``broken`` is set."""

    broken = False

    def write_batch(self, **rows: object) -> None:  # type: ignore[override]
        if self.broken:
            raise Unavailable("the registry database cannot be used right now")
        super().write_batch(**rows)  # type: ignore[arg-type]


def _writer(handle: str, state: str) -> WriterRecord:
    return WriterRecord(handle, "cp", f"id-{handle}", "host", 1, {}, {}, state, 1.0, 2.0)


def test_queued_rows_survive_a_failed_flush_and_the_newest_writer_row_wins(tmp_path: Path) -> None:
    registry = BrokenRegistry(default_sqlite_url(tmp_path))

    async def run(fn: object) -> object:
        assert callable(fn)
        return fn()

    writer = RegistryWriter(registry, run)

    async def scenario() -> None:
        writer.writer(_writer("h1", "open"))
        writer.event(EventRecord("cp", "writer_opened", "first", 1.0))
        registry.broken = True
        with pytest.raises(Unavailable):
            await writer.flush()
        assert writer.queued == 2
        writer.writer(_writer("h1", "closed"))  # newer than the queued row of the same writer
        writer.event(EventRecord("cp", "writer_closed", "second", 2.0))
        registry.broken = False
        await writer.flush()
        assert writer.queued == 0

    asyncio.run(scenario())
    assert [w.state for w in registry.list_writers("cp")] == ["closed"]
    assert [e.message for e in registry.list_events("cp")] == ["second", "first"]  # newest first, in order


def test_events_past_the_bound_drop_the_oldest_and_are_counted(tmp_path: Path) -> None:
    writer = RegistryWriter(SqlRegistry(default_sqlite_url(tmp_path)), lambda fn: fn(), max_events=3)
    for i in range(5):
        writer.event(EventRecord("cp", "kind", str(i), float(i)))
    assert writer.dropped_events == 2
    assert writer.queued == 3


def test_a_flush_cancelled_while_its_write_runs_neither_writes_twice_nor_loses_rows(tmp_path: Path) -> None:
    """A coordinator stopping cancels its registry loop mid-flush; the last flush must not write again."""
    registry = SqlRegistry(default_sqlite_url(tmp_path))
    writing, finish = threading.Event(), threading.Event()

    async def run(fn: object) -> object:
        assert callable(fn)

        def gated() -> object:
            writing.set()
            finish.wait(30)
            return fn()

        return await asyncio.get_running_loop().run_in_executor(None, gated)

    writer = RegistryWriter(registry, run)

    async def scenario() -> None:
        writer.writer(_writer("h1", "open"))
        writer.event(EventRecord("cp", "writer_opened", "first", 1.0))
        writer.samples([ProgressRecord("cp", 1.5, 3)])
        flushing = asyncio.create_task(writer.flush())
        await asyncio.to_thread(writing.wait, 30)
        flushing.cancel()  # the loop stops while the write is in its thread
        await asyncio.sleep(0)
        finish.set()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        # What the cancelled flush wrote is not queued again: the last flush has nothing to write
        # (before, it wrote the same rows again, and the sample's key twice failed the batch).
        assert writer.queued == 0
        writer.event(EventRecord("cp", "writer_closed", "second", 2.0))
        await writer.flush()

    asyncio.run(scenario())
    assert [e.message for e in registry.list_events("cp")] == ["second", "first"]
    assert [(s.at, s.completed_count) for s in registry.list_samples("cp")] == [(1.5, 3)]
