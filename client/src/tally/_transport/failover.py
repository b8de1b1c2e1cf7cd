"""Several coordinator replicas behind one transport: the current one gets every call.

An address such as ``h1:50051,h2:50051,h3:50051`` makes one transport per replica (see
``base.make_transport``) and one of these around them. Each client starts on a random replica, so
the clients of a fleet spread their calls over all of them. A call that fails with
:class:`tally.Unavailable` moves the client to the next replica (round robin) and the error goes
on up unchanged: the layers that already retry ``Unavailable`` within the caller's deadline
(``tally._retry.send``, a writer's batch resend and heartbeat) then retry on that replica. Every
other error is the coordinator's answer and moves nothing.

Reads are spread: each ``are_completed`` call goes to the next replica in turn (every replica
answers them, from the store's database), skipping for ``READ_PAUSE_S`` one that did not answer
the last time; everything else goes to the current replica.

The first retry after a move waits ``retry_initial_s`` (50 ms by default, less jitter), so one
replica down costs a call about that much: it was not worth teaching the retry layer about moves.

A refused first connection (``tally._transport.contact``) fails a call at once only when every
replica has refused one since it last answered: one replica not started yet is just a move.

Several threads or tasks may fail on the same replica at once; only the first failure moves, the
others find the client already elsewhere (a generation number tells them apart), so one outage
never skips a healthy replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tally._calls import AreCompleted, Call, WatchCheckpoint
from tally._transport.base import AsyncTransport, Transport  # base imports this module lazily
from tally._transport.contact import NeverReached, never_reached
from tally._transport.dns import LOOKUP_EVERY_S
from tally._types import CheckpointStatus
from tally.errors import Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long reads pass by a replica that did not answer one (writers' calls move as described above).
READ_PAUSE_S = 5.0
Tr = TypeVar("Tr")  # a replica's transport (blocking or asyncio)
# Looks the replicas up again: each one's name and how to make its transport.
Lookup = Callable[[], list[tuple[str, Callable[[], Tr]]]]


def first_replica(count: int) -> int:
    """Where a new client starts: a random replica (a function of its own so tests can pin it)."""
    return random.randrange(count)


class Rotation:
    """Which replica is current, and the one rule for leaving it; shared by both flavours.

    ``current()`` returns the replica's index with a generation number that grows with every
    move; ``failed()`` with that pair moves only if nobody moved since, which is what keeps
    concurrent failures of one replica from moving twice (an index alone could have come round
    again in the meantime).
    """

    def __init__(self, names: Sequence[str], start: int) -> None:
        if not names:
            raise ValueError("a rotation needs at least one replica")
        self.names = list(names)
        self._generation = start  # the current index is the generation modulo the count
        self._lock = threading.Lock()

    def current(self) -> tuple[int, int]:
        """The current replica's index and the generation it was read at."""
        generation = self._generation
        return generation % len(self.names), generation

    def failed(self, generation: int, err: Unavailable) -> None:
        """A call sent at ``generation`` got no answer: move on, unless someone already did."""
        with self._lock:
            if generation != self._generation:
                return
            self._generation += 1
        count = len(self.names)
        logger.info(
            "tally coordinator %s is unavailable, moving to %s: %s",
            self.names[generation % count],
            self.names[(generation + 1) % count],
            err.message,
        )


@dataclass
class _View(Generic[Tr]):
    """The replicas a client spreads over now, and what it knows of them; replaced whole when a
    DNS name's records change, so a call holds one view from start to end."""

    names: list[str]
    transports: list[Tr]
    rotation: Rotation
    reads: Iterator[int]
    read_pause_until: list[float]
    never_reached: set[int]  # replicas whose first connection was refused

    @classmethod
    def of(cls, replicas: Sequence[tuple[str, Tr]], start: int) -> _View[Tr]:
        names = [name for name, _ in replicas]
        rotation = Rotation(names, start)
        return cls(
            names=names,
            transports=[transport for _, transport in replicas],
            rotation=rotation,
            reads=itertools.count(rotation.current()[0]),  # next() is atomic in CPython
            read_pause_until=[0.0] * len(names),
            never_reached=set(),
        )


class _Replicas(Generic[Tr]):
    """One transport per replica and the rotation over them: what both flavours hold."""

    def __init__(
        self,
        replicas: Sequence[tuple[str, Tr]],
        *,
        start: int | None = None,
        lookup: Lookup[Tr] | None = None,
    ) -> None:
        """Wrap one transport per replica.

        Args:
            replicas: Each replica's name (for logs) and transport, in the order given by the user.
            start: Index of the first current replica; None picks one at random.
            lookup: How to find the replicas again (a DNS name's records, ``tally._transport.dns``):
                each replica's name and how to make its transport. Called, at most every
                ``dns.LOOKUP_EVERY_S``, when a replica does not answer; None: the replicas are fixed.
        """
        self._view = _View.of(replicas, first_replica(len(replicas)) if start is None else start)
        self._lookup = lookup
        self._next_lookup = time.monotonic() + LOOKUP_EVERY_S
        self._lookup_lock = threading.Lock()
        self._left: list[Tr] = []  # transports of replicas that left the name: closed with the client

    def _answered(self, view: _View[Tr], index: int) -> None:
        view.never_reached.discard(index)

    def _unavailable(self, view: _View[Tr], index: int, err: Unavailable) -> Unavailable:
        """What a replica's failure becomes: a :class:`NeverReached` only once every replica refused
        its first connection (naming them all); otherwise a plain, retryable :class:`Unavailable`."""
        if not isinstance(err, NeverReached):
            return err
        view.never_reached.add(index)
        if len(view.never_reached) < len(view.transports):
            return err.refused
        return never_reached(", ".join(view.names), err.refused)

    def _reader(self, view: _View[Tr], call: Call[T]) -> int | None:
        """The replica a read goes to (the next one answering reads), or None for other calls."""
        if not isinstance(call, AreCompleted):
            return None
        now = time.monotonic()
        count = len(view.transports)
        for _ in range(count):
            index = next(view.reads) % count
            if view.read_pause_until[index] <= now:
                return index
        return None  # none answered lately: the current replica, like any other call

    def _read_failed(self, view: _View[Tr], index: int, err: Unavailable) -> None:
        view.read_pause_until[index] = time.monotonic() + READ_PAUSE_S
        logger.info(
            "tally coordinator %s did not answer a read, reads pass it by for %.0f s: %s",
            view.names[index],
            READ_PAUSE_S,
            err.message,
        )

    def _lookup_due(self) -> Lookup[Tr] | None:
        """The lookup to run now, if the replicas come from a name not looked up lately."""
        if self._lookup is None:
            return None
        now = time.monotonic()
        with self._lookup_lock:
            if now < self._next_lookup:
                return None
            self._next_lookup = now + LOOKUP_EVERY_S
        return self._lookup

    def _found(self, found: Sequence[tuple[str, Callable[[], Tr]]]) -> None:
        """Spread over the replicas ``found`` from now on (those still there keep their transport)."""
        view = self._view
        if not found or [name for name, _ in found] == view.names:
            return
        kept = dict(zip(view.names, view.transports, strict=True))
        replicas = [(name, kept.pop(name) if name in kept else make()) for name, make in found]
        names = [name for name, _ in replicas]
        current = view.names[view.rotation.current()[0]]
        start = names.index(current) if current in names else first_replica(len(names))
        self._left.extend(kept.values())  # a call may still be on them: closed with the client
        self._view = _View.of(replicas, start)
        logger.info(
            "tally coordinator replicas are now %s (were %s)", ", ".join(names), ", ".join(view.names)
        )

    @property
    def current(self) -> str:
        """The name of the replica that gets the next call."""
        view = self._view
        return view.names[view.rotation.current()[0]]

    @property
    def replicas(self) -> list[str]:
        """The names of the replicas spread over now."""
        return list(self._view.names)


class FailoverTransport(_Replicas[Transport]):
    """Blocking transport over several replicas' transports (see the module docstring)."""

    def send(self, call: Call[T], timeout: float) -> T:
        view = self._view
        reader = self._reader(view, call)
        if reader is not None:
            try:
                answer = view.transports[reader].send(call, timeout)
            except Unavailable as err:
                self._read_failed(view, reader, err)
                raise self._failed(view, reader, err) from None
            self._answered(view, reader)
            return answer
        index, generation = view.rotation.current()
        try:
            answer = view.transports[index].send(call, timeout)
        except Unavailable as err:
            view.rotation.failed(generation, err)
            raise self._failed(view, index, err) from None
        self._answered(view, index)
        return answer

    def _failed(self, view: _View[Transport], index: int, err: Unavailable) -> Unavailable:
        """The error a replica's failure becomes, after looking its name up again if that is due."""
        lookup = self._lookup_due()
        if lookup is not None:
            self._found(lookup())
        return self._unavailable(view, index, err)

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        view = self._view
        index, generation = view.rotation.current()
        return self._watch(view, view.transports[index].watch(call, timeout), index, generation)

    def _watch(
        self,
        view: _View[Transport],
        stream: Generator[CheckpointStatus, None, None],
        index: int,
        generation: int,
    ) -> Generator[CheckpointStatus, None, None]:
        # Unavailable while opening or later: that replica let the stream down, and the caller's
        # reconnect should find the next one.
        try:
            for status in stream:
                self._answered(view, index)
                yield status
        except Unavailable as err:
            view.rotation.failed(generation, err)
            raise self._failed(view, index, err) from None
        finally:
            stream.close()

    def close(self) -> None:
        """Close every replica's transport, even if closing one fails (the first error is raised)."""
        errors: list[Exception] = []
        for transport in [*self._view.transports, *self._left]:
            try:
                transport.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]


class AsyncFailoverTransport(_Replicas[AsyncTransport]):
    """asyncio twin of :class:`FailoverTransport`."""

    async def send(self, call: Call[T], timeout: float) -> T:
        view = self._view
        reader = self._reader(view, call)
        if reader is not None:
            try:
                answer = await view.transports[reader].send(call, timeout)
            except Unavailable as err:
                self._read_failed(view, reader, err)
                raise await self._failed(view, reader, err) from None
            self._answered(view, reader)
            return answer
        index, generation = view.rotation.current()
        try:
            answer = await view.transports[index].send(call, timeout)
        except Unavailable as err:
            view.rotation.failed(generation, err)
            raise await self._failed(view, index, err) from None
        self._answered(view, index)
        return answer

    async def _failed(self, view: _View[AsyncTransport], index: int, err: Unavailable) -> Unavailable:
        """As :meth:`FailoverTransport._failed`; the lookup runs on a thread, off the event loop."""
        lookup = self._lookup_due()
        if lookup is not None:
            self._found(await asyncio.get_running_loop().run_in_executor(None, lookup))
        return self._unavailable(view, index, err)

    def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]:
        view = self._view
        index, generation = view.rotation.current()
        return self._watch(view, view.transports[index].watch(call, timeout), index, generation)

    async def _watch(
        self,
        view: _View[AsyncTransport],
        stream: AsyncGenerator[CheckpointStatus, None],
        index: int,
        generation: int,
    ) -> AsyncGenerator[CheckpointStatus, None]:
        try:
            async for status in stream:
                self._answered(view, index)
                yield status
        except Unavailable as err:
            view.rotation.failed(generation, err)
            raise await self._failed(view, index, err) from None
        finally:
            await stream.aclose()

    async def close(self) -> None:
        """Close every replica's transport (see :meth:`FailoverTransport.close`)."""
        errors: list[Exception] = []
        for transport in [*self._view.transports, *self._left]:
            try:
                await transport.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]
