"""Write-behind for the registry's bookkeeping: writer rows, events and progress samples.

None of these is completion state (that is in the completion files, written by the group
committer), so none of them needs to hold up a request: keep-alives, closes, anomalies and
samples queue their rows here and one background flush writes them in one transaction. A
heartbeat therefore never waits for the database, and a registry that is down or full delays
bookkeeping instead of failing writers; rows wait (writer rows coalesced per handle, events up
to a bound) and are written once the database answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tally_server.domain.ports import EventRecord, ProgressRecord, Registry, WriterRecord
from tally_server.domain.words import count
from tally_server.errors import RegistryFenced

log = logging.getLogger(__name__)
T = TypeVar("T")

# Events waiting for a registry that is down; past this the oldest are dropped (and counted).
MAX_QUEUED_EVENTS = 100_000


class RegistryWriter:
    """Queues bookkeeping rows and writes them in batches.

    Args:
        registry: the registry.
        run: runs a blocking registry call off the event loop.
        max_events: queued events kept while the registry is unreachable.
    """

    def __init__(
        self,
        registry: Registry,
        run: Callable[..., Awaitable[Any]],
        *,
        max_events: int = MAX_QUEUED_EVENTS,
    ) -> None:
        self._registry = registry
        self._run = run
        self._writers: dict[str, WriterRecord] = {}
        self._events: deque[EventRecord] = deque()
        self._samples: list[ProgressRecord] = []
        self._max_events = max_events
        self._lock = asyncio.Lock()
        self.dropped_events = 0

    def writer(self, record: WriterRecord) -> None:
        """Queue a writer row; a newer row of the same handle replaces a queued one."""
        self._writers[record.handle] = record

    def event(self, record: EventRecord) -> None:
        """Queue an event; beyond the queue's bound the oldest is dropped (and counted)."""
        self._events.append(record)
        if len(self._events) > self._max_events:
            self._events.popleft()
            self.dropped_events += 1
            if self.dropped_events == 1:
                log.error(
                    "the registry has not accepted events for a while; more than %d are queued, so "
                    "the oldest are dropped from now on (counted in tally_registry_events_dropped_total)",
                    self._max_events,
                )

    def samples(self, records: Sequence[ProgressRecord]) -> None:
        """Queue progress samples."""
        self._samples.extend(records)

    def forget_samples(self, checkpoint: str) -> None:
        """Drop queued samples of a checkpoint that was reset (its history starts over)."""
        self._samples = [x for x in self._samples if x.checkpoint != checkpoint]

    def queued_writers(self, checkpoint: str) -> list[WriterRecord]:
        """Writer rows not yet written, so status reads never miss a writer that just closed."""
        return [r for r in self._writers.values() if r.checkpoint == checkpoint]

    def queued_samples(self, checkpoint: str) -> list[ProgressRecord]:
        """The checkpoint's samples still waiting to be written."""
        return [x for x in self._samples if x.checkpoint == checkpoint]

    @property
    def queued(self) -> int:
        """Rows waiting to be written."""
        return len(self._writers) + len(self._events) + len(self._samples)

    async def flush(self) -> None:
        """Write everything queued so far in one transaction.

        A batch the store's fence refuses (``RegistryFenced``: rows of checkpoints whose shard this
        coordinator lost or gave up) is written again at once without the rows that can never pass
        here, which are dropped with a warning (their new owner restored those checkpoints from the
        registry as it was); the rest is written, or stays queued as below.

        Raises:
            Unavailable: the registry cannot be written; the rows stay queued for the next flush.
        """
        async with self._lock:
            while self.queued:
                try:
                    await self._flush_once()
                    return
                except RegistryFenced as exc:
                    dropped = self._drop(exc.refused)
                    if not dropped:
                        raise  # refused for a shard none of them is in: queued, for the next flush
                    names = sorted(exc.refused)
                    log.warning(
                        "dropped the registry's rows of %s (%s), which this coordinator may no longer "
                        "write; writing the others again: %s",
                        ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
                        count(dropped, "row"),
                        exc.message,
                    )

    def _drop(self, checkpoints: frozenset[str]) -> int:
        """Drop the queued rows of ``checkpoints``; returns how many were dropped."""
        before = self.queued
        self._writers = {h: r for h, r in self._writers.items() if r.checkpoint not in checkpoints}
        self._events = deque(e for e in self._events if e.checkpoint not in checkpoints)
        self._samples = [x for x in self._samples if x.checkpoint not in checkpoints]
        return before - self.queued

    async def _flush_once(self) -> None:
        """One transaction of everything queued; on failure the rows are queued again, in front."""
        writers, self._writers = self._writers, {}
        events, self._events = list(self._events), deque()
        samples, self._samples = self._samples, []
        write = asyncio.ensure_future(
            self._run(
                lambda: self._registry.write_batch(
                    writers=list(writers.values()), events=events, samples=samples
                )
            )
        )
        # The write goes on in its thread whatever happens to this task: a flush cancelled
        # meanwhile (the coordinator stopping) waits for its outcome, so the rows are neither
        # put back although written (the last flush then wrote them twice, and a progress
        # sample's key twice failed the whole batch) nor lost.
        stopped = False  # this task was cancelled while the write went on
        while not write.done():
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                stopped = stopped or not write.done()
            except BaseException:
                pass  # the write's own failure: below
        failure: BaseException | None = asyncio.CancelledError() if write.cancelled() else write.exception()
        if failure is not None:
            # Put them back in front of anything queued meanwhile (which is newer).
            for handle, record in writers.items():
                self._writers.setdefault(handle, record)
            self._events.extendleft(reversed(events))
            self._samples[:0] = samples
        if stopped:
            raise asyncio.CancelledError
        if failure is not None:
            raise failure
