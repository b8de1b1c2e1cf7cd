"""One thread running blocking calls in order, each answered as an asyncio future (the group committer's)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Lane:
    """One thread running blocking calls in the order given, each answered as an asyncio future.

    What ``loop.run_in_executor`` on a one-thread ``ThreadPoolExecutor`` does, without its
    per-submit semaphore: that one is released by the worker thread after each call, so the loop
    often stops on it until that thread is scheduled again (tens of microseconds per commit, ten
    times that at the tail on a busy machine). A queue and a callback into the loop are all a
    commit needs.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._stopped = False
        # A daemon: close() stops it; a process that dies without close() loses no acknowledged
        # work, since nothing is answered before its commit returned.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(
        self, fn: Callable[..., T], *args: object, then: Callable[[], None] | None = None
    ) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; the future has its result or exception.

        ``then`` runs on the loop as soon as ``fn`` returned (not if it raised), before the
        awaiting coroutine resumes: what it wakes runs one turn of the loop earlier.
        """
        if self._stopped:  # as an executor after shutdown: nothing would ever run it
            raise RuntimeError(f"{self._thread.name} is shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args, then))
        return future

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, fn, args, then = item
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting coroutine, as an executor does
                _answer(loop, future.set_exception, future, exc, None)
            else:
                _answer(loop, future.set_result, future, result, then)
            del item, future, args, then  # hold no reference to the last call while waiting


def _answer(
    loop: asyncio.AbstractEventLoop,
    setter: Callable[[Any], None],
    future: Any,
    value: Any,
    then: Callable[[], None] | None,
) -> None:
    def settle() -> None:
        if not future.done():  # cancelled meanwhile
            setter(value)
        if then is not None:
            then()

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(settle)
