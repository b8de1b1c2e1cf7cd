"""What every part of the service shares.

Limits, clocks, the session table, and the doors to the stores (the group committer, the
registry's threads and its write-behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tally_server.domain.events import EventKind
from tally_server.domain.ports import CompletionStore, EventRecord, Registry
from tally_server.domain.validation import Limits
from tally_server.errors import NotOwned, Unavailable
from tally_server.service.committer import GroupCommitter
from tally_server.service.registry_writer import RegistryWriter
from tally_server.service.sessions import SessionTable
from tally_server.service.stats import ServiceStats
from tally_server.service.views import ReplicasView

log = logging.getLogger("tally_server.service")
T = TypeVar("T")


class CallsInFlight:
    """The calls at work on each checkpoint, so that giving a checkpoint up waits for its calls.

    ``CoordinatorService`` counts every call that may write for a checkpoint (or a writer of one)
    from its start to its answer; :meth:`drained` waits until none is left for some checkpoints.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._waiters: list[asyncio.Future[None]] = []

    @contextlib.contextmanager
    def on(self, checkpoint: str | None) -> Iterator[None]:
        """Count a call on ``checkpoint`` while the block runs (None: a call naming none known)."""
        if checkpoint is None:
            yield
            return
        self._counts[checkpoint] += 1
        try:
            yield
        finally:
            self._counts[checkpoint] -= 1
            if not self._counts[checkpoint]:
                del self._counts[checkpoint]
                waiters, self._waiters = self._waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    async def drained(self, which: Callable[[str], bool]) -> None:
        """Return once no call is at work on a checkpoint ``which`` accepts."""
        while any(which(name) for name in self._counts):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter


@dataclass
class Core:
    """Shared by the checkpoint table, the writers, status and admin operations.

    ``clock`` is lease time (a stall clock: leases and settle windows), ``real_clock`` plain
    monotonic time, ``wall`` epoch seconds for what people read.
    """

    limits: Limits
    settle_ms: int
    lease_ttl_s: float
    clock: Callable[[], float]
    real_clock: Callable[[], float]
    wall: Callable[[], float]
    completions: CompletionStore
    registry: Registry
    committer: GroupCommitter
    bookkeeping: RegistryWriter
    stats: ServiceStats
    journal_snapshot_deltas: int = 100_000
    sessions: SessionTable = field(default_factory=SessionTable)
    # Writes (the two that requests wait for, and the bookkeeping flushes) never queue behind
    # status reads, which get threads of their own.
    registry_writes: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tally-registry-write")
    )
    registry_reads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tally-registry-read")
    )
    accepting: bool = False
    # Why this coordinator cannot be sure it still serves its store (no contact with the database
    # for longer than a standby waits before taking over), or None. Reads of completions are then
    # refused: another coordinator may have changed them since.
    store_unconfirmed: str | None = None
    # On a PostgreSQL store: this coordinator's name among the store's replicas (it owns the store
    # while it serves), and how to list them all (a blocking database read).
    owner_name: str = ""
    list_replicas: Callable[[], ReplicasView] | None = None
    # On a PostgreSQL store: writes the checkpoints' statuses that changed (and, given the names to
    # keep, drops the others') for the replicas to answer status reads from (blocking; False if the
    # store is no longer this coordinator's). See ``store.pg_status``.
    publish_status: Callable[[Mapping[str, Any], Sequence[str] | None], bool] | None = None
    # On a store of several shards: the names of the checkpoints other coordinators publish, and
    # their published statuses (blocking reads; ``CoordinatorService.list_elsewhere``).
    list_elsewhere: tuple[Callable[[], list[str]], Callable[[Sequence[str]], Mapping[str, Any]]] | None = None
    # On a store of several shards: what a new writer handle of a checkpoint ends with (its shard, so
    # any coordinator routes the writer's calls without a lookup; ``sharding.tag_handle``).
    handle_tag: Callable[[str], str] | None = None
    # Which checkpoints this coordinator owns (None: all of them; see ``CoordinatorService``).
    owns: Callable[[str], bool] | None = None
    calls: CallsInFlight = field(default_factory=CallsInFlight)
    _behind: set[asyncio.Task[None]] = field(default_factory=set)

    async def registry_write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking registry write on the registry's one writing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.registry_writes, fn, *args)

    def write_behind(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run a registry write behind the answer: a failure is logged as ``could not <what>``.

        For writes whose loss the next start or a read repairs (claims released, cursors and
        failures of completed sources). Shutdown waits for them (:meth:`settle_behind`).
        """

        async def write() -> None:
            try:
                await self.registry_write(fn, *args)
            except Exception as exc:
                log.warning("could not %s: %s", what, exc)

        task = asyncio.get_running_loop().create_task(write(), name=f"tally-behind-{fn.__name__}")
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    async def settle_behind(self) -> None:
        """Wait for the registry writes behind answers (on shutdown)."""
        if self._behind:
            await asyncio.gather(*self._behind, return_exceptions=True)

    async def registry_read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking registry read on the reading threads, never behind writes."""
        return await asyncio.get_running_loop().run_in_executor(self.registry_reads, fn, *args)

    def event(
        self, checkpoint: str, kind: EventKind, message: str, writer_id: str | None = None, **data: Any
    ) -> None:
        """Log an event now and queue it for the registry (written by the registry loop)."""
        fields = {"checkpoint": checkpoint, "event": kind.value, "writer": writer_id}
        log.info("%s [%s] %s", checkpoint, kind, message, extra=fields)
        self.bookkeeping.event(EventRecord(checkpoint, kind, message, self.wall(), writer_id, dict(data)))

    def check_accepting(self) -> None:
        """Refuse work (UNAVAILABLE) while the coordinator is starting or shutting down."""
        if not self.accepting:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")

    def check_owned(self, checkpoint: str) -> None:
        """Refuse (UNAVAILABLE, :class:`NotOwned`) a call naming a checkpoint another coordinator owns."""
        if self.owns is not None and not self.owns(checkpoint):
            raise NotOwned(checkpoint, self.owner_name)

    def check_reads(self) -> None:
        """Refuse reads of completions (UNAVAILABLE) while the store's ownership is unconfirmed."""
        self.check_accepting()
        if self.store_unconfirmed is not None:
            raise Unavailable(
                f"this coordinator cannot answer for completions now: {self.store_unconfirmed}; retry "
                "(another coordinator may have taken the store over: clients given several addresses "
                "move on by themselves)"
            )
