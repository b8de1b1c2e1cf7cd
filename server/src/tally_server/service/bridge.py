"""The service as seen from another thread's event loop.

The HTTP server runs on a thread and event loop of its own, so that however many status reads
arrive over HTTP, the service's loop keeps turning: gRPC accepts new calls (heartbeats included)
one per turn of the loop it runs on, and a loop busy with HTTP requests would make every gRPC
call wait. Domain state still lives on one loop only: :class:`ServiceBridge` runs each call of
the service on the service's loop and hands the result back, carrying the caller's context
(request id) along.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class ServiceBridge:
    """Calls a service that lives on ``loop`` from coroutines running on other loops.

    Coroutine methods run on ``loop``; async generators (watch streams) are iterated there;
    plain methods and attributes are read there too, since domain state must only be touched by
    its own loop. Called from ``loop`` itself, everything runs directly.
    """

    def __init__(self, service: object, loop: asyncio.AbstractEventLoop) -> None:
        self._service = service
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._service, name)
        if inspect.iscoroutinefunction(attr):

            async def call(*args: Any, **kwargs: Any) -> Any:
                return await self.run(attr(*args, **kwargs))

            return call
        if inspect.isasyncgenfunction(attr):
            return lambda *args, **kwargs: self._iterate(attr(*args, **kwargs))
        if callable(attr):
            return lambda *args, **kwargs: self.call_sync(attr, *args, **kwargs)
        return attr

    def _here(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the service's loop, in a copy of the caller's context."""
        if self._here():
            return await coro
        context = contextvars.copy_context()
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            if not result.set_running_or_notify_cancel():
                coro.close()
                return
            task = self._loop.create_task(coro, context=context)

            def done(t: asyncio.Task[T]) -> None:
                if t.cancelled():
                    result.cancel()
                elif (exc := t.exception()) is not None:
                    result.set_exception(exc)
                else:
                    result.set_result(t.result())

            task.add_done_callback(done)
            # The caller went away (client disconnected): stop the work on the service's loop too.
            result.add_done_callback(lambda f: f.cancelled() and self._loop.call_soon_threadsafe(task.cancel))

        self._loop.call_soon_threadsafe(start)
        return await asyncio.wrap_future(result)

    def call_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a plain function on the service's loop and wait for its result (briefly blocking)."""
        if self._here():
            return fn(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(_call(fn, *args, **kwargs), self._loop)
        return future.result()

    async def _iterate(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        try:
            while True:
                try:
                    item = await self.run(_next(stream))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await self.run(aclose())


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


async def _next(stream: AsyncIterator[T]) -> T:
    return await stream.__anext__()
