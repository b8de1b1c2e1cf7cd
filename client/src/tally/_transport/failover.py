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

import itertools
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Generic, TypeVar

from tally._calls import AreCompleted, Call, WatchCheckpoint
from tally._transport.base import AsyncTransport, Transport  # base imports this module lazily
from tally._transport.contact import NeverReached, never_reached
from tally._types import CheckpointStatus
from tally.errors import Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long reads pass by a replica that did not answer one (writers' calls move as described above).
READ_PAUSE_S = 5.0
Tr = TypeVar("Tr")  # a replica's transport (blocking or asyncio)


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
        if len(names) < 2:
            raise ValueError(f"a rotation needs at least two replicas, got {list(names)}")
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


class _Replicas(Generic[Tr]):
    """One transport per replica and the rotation over them: what both flavours hold."""

    def __init__(self, replicas: Sequence[tuple[str, Tr]], *, start: int | None = None) -> None:
        """Wrap one transport per replica.

        Args:
            replicas: Each replica's name (for logs) and transport, in the order given by the user.
            start: Index of the first current replica; None picks one at random.
        """
        self._transports = [transport for _, transport in replicas]
        names = [name for name, _ in replicas]
        self._rotation = Rotation(names, first_replica(len(names)) if start is None else start)
        self._reads = itertools.count(self._rotation.current()[0])  # next() is atomic in CPython
        self._read_pause_until = [0.0] * len(names)
        self._never_reached: set[int] = set()  # replicas whose first connection was refused

    def _answered(self, index: int) -> None:
        self._never_reached.discard(index)

    def _unavailable(self, index: int, err: Unavailable) -> Unavailable:
        """What a replica's failure becomes: a :class:`NeverReached` only once every replica refused
        its first connection (naming them all); otherwise a plain, retryable :class:`Unavailable`."""
        if not isinstance(err, NeverReached):
            return err
        self._never_reached.add(index)
        if len(self._never_reached) < len(self._transports):
            return err.refused
        return never_reached(", ".join(self._rotation.names), err.refused)

    def _reader(self, call: Call[T]) -> int | None:
        """The replica a read goes to (the next one answering reads), or None for other calls."""
        if not isinstance(call, AreCompleted):
            return None
        now = time.monotonic()
        count = len(self._transports)
        for _ in range(count):
            index = next(self._reads) % count
            if self._read_pause_until[index] <= now:
                return index
        return None  # none answered lately: the current replica, like any other call

    def _read_failed(self, index: int, err: Unavailable) -> None:
        self._read_pause_until[index] = time.monotonic() + READ_PAUSE_S
        logger.info(
            "tally coordinator %s did not answer a read, reads pass it by for %.0f s: %s",
            self._rotation.names[index],
            READ_PAUSE_S,
            err.message,
        )

    @property
    def current(self) -> str:
        """The name of the replica that gets the next call."""
        return self._rotation.names[self._rotation.current()[0]]


class FailoverTransport(_Replicas[Transport]):
    """Blocking transport over several replicas' transports (see the module docstring)."""

    def send(self, call: Call[T], timeout: float) -> T:
        reader = self._reader(call)
        if reader is not None:
            try:
                answer = self._transports[reader].send(call, timeout)
            except Unavailable as err:
                self._read_failed(reader, err)
                raise self._unavailable(reader, err) from None
            self._answered(reader)
            return answer
        index, generation = self._rotation.current()
        try:
            answer = self._transports[index].send(call, timeout)
        except Unavailable as err:
            self._rotation.failed(generation, err)
            raise self._unavailable(index, err) from None
        self._answered(index)
        return answer

    def watch(self, call: WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        index, generation = self._rotation.current()
        return self._watch(self._transports[index].watch(call, timeout), index, generation)

    def _watch(
        self, stream: Generator[CheckpointStatus, None, None], index: int, generation: int
    ) -> Generator[CheckpointStatus, None, None]:
        # Unavailable while opening or later: that replica let the stream down, and the caller's
        # reconnect should find the next one.
        try:
            for status in stream:
                self._answered(index)
                yield status
        except Unavailable as err:
            self._rotation.failed(generation, err)
            raise self._unavailable(index, err) from None
        finally:
            stream.close()

    def close(self) -> None:
        """Close every replica's transport, even if closing one fails (the first error is raised)."""
        errors: list[Exception] = []
        for transport in self._transports:
            try:
                transport.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]


class AsyncFailoverTransport(_Replicas[AsyncTransport]):
    """asyncio twin of :class:`FailoverTransport`."""

    async def send(self, call: Call[T], timeout: float) -> T:
        reader = self._reader(call)
        if reader is not None:
            try:
                answer = await self._transports[reader].send(call, timeout)
            except Unavailable as err:
                self._read_failed(reader, err)
                raise self._unavailable(reader, err) from None
            self._answered(reader)
            return answer
        index, generation = self._rotation.current()
        try:
            answer = await self._transports[index].send(call, timeout)
        except Unavailable as err:
            self._rotation.failed(generation, err)
            raise self._unavailable(index, err) from None
        self._answered(index)
        return answer

    def watch(self, call: WatchCheckpoint, timeout: float) -> AsyncGenerator[CheckpointStatus, None]:
        index, generation = self._rotation.current()
        return self._watch(self._transports[index].watch(call, timeout), index, generation)

    async def _watch(
        self, stream: AsyncGenerator[CheckpointStatus, None], index: int, generation: int
    ) -> AsyncGenerator[CheckpointStatus, None]:
        try:
            async for status in stream:
                self._answered(index)
                yield status
        except Unavailable as err:
            self._rotation.failed(generation, err)
            raise self._unavailable(index, err) from None
        finally:
            await stream.aclose()

    async def close(self) -> None:
        """Close every replica's transport (see :meth:`FailoverTransport.close`)."""
        errors: list[Exception] = []
        for transport in self._transports:
            try:
                await transport.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]
