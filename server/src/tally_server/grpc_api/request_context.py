"""The outermost gRPC interceptor: a request id for every call, and latency of unary calls.

The id comes from the caller's ``x-request-id`` metadata (or is made up), is set in
:data:`tally_server.logs.request_id` for every log line the call causes, and is echoed: in the
trailing metadata of a unary call (sent with its status, on every path, aborts included: the error
interceptor keeps it beside the details it adds), in the initial metadata of a stream (which
reaches the caller before the first message). Initial metadata on a unary call would cost an
operation of its own, a tenth of a millisecond per call.

Streaming calls (WatchCheckpoint, health Watch, reflection) get the request id but are not timed:
their duration is how long a client watched, not how fast Tally answered, and would drown the
latency quantiles.

Every call gets an access line (:func:`tally_server.logs.access`) when it ends, streams included;
the methods in :data:`QUIET_METHODS` only at DEBUG unless they fail. A unary call's line and its
latency observation are made on the next turn of the event loop, once the answer is on its way:
they cost as much as a small call's own work, and the caller need not wait for them.

Each method's handler is wrapped once and reused for every call (the wrapper reads the call's
metadata from its context), not rebuilt per call.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from tally_server import logs
from tally_server.grpc_api.wrapping import WrappingInterceptor

REQUEST_ID_KEY = "x-request-id"
# Sent by every writer every few seconds, or by health checkers: access lines at DEBUG.
QUIET_METHODS = frozenset(
    {"/tally.v1.Coordinator/KeepAlive", "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
)


def _incoming_id(metadata: Any) -> str | None:
    for item in metadata or ():
        key, value = item
        if key == REQUEST_ID_KEY and isinstance(value, str):
            return value
    return None


def _stream_ended(method: str, code: grpc.StatusCode | None, left: bool, elapsed: float, peer: str) -> None:
    """A stream's access line, from what was read of the call while it was there.

    Nothing here may touch the call: the caller may be gone, and with it the call's core object
    (``context.peer()`` then reads freed memory: a segfault, about one cancelled watch in ten).
    """
    if left and code in (None, grpc.StatusCode.OK):
        code = grpc.StatusCode.CANCELLED
    _logged(method, code or grpc.StatusCode.OK, elapsed, peer)


def _logged(method: str, code: grpc.StatusCode, elapsed: float, peer: str) -> None:
    ok = code == grpc.StatusCode.OK
    logs.access("grpc", method, code.name, elapsed, peer, quiet=method in QUIET_METHODS, ok=ok)


def _finished(
    latency: Callable[[str, grpc.StatusCode], Histogram],
    method: str,
    code: grpc.StatusCode,
    cancelled: bool,
    elapsed: float,
    peer: str,
) -> None:
    latency(method, code).observe(elapsed)
    if code == grpc.StatusCode.OK and cancelled:
        code = grpc.StatusCode.CANCELLED  # the caller left before the answer
    _logged(method, code, elapsed, peer)


def _caller_id(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    return _incoming_id(context.invocation_metadata())


class RequestInterceptor(WrappingInterceptor):
    """Request ids for all calls; ``tally_grpc_request_duration_seconds{method, code}`` for unary ones.

    Put it first in the interceptor list so it wraps the error interceptor and sees the final code.
    """

    def __init__(self, latency: Histogram) -> None:
        super().__init__()
        self._latency = latency
        # The histogram's child per (method, code), so a call skips labels()' lock and checks.
        self._children: dict[tuple[str, grpc.StatusCode], Histogram] = {}

    def _child(self, method: str, code: grpc.StatusCode) -> Histogram:
        child = self._children.get((method, code))
        if child is None:
            child = self._children[(method, code)] = self._latency.labels(method, code.name)
        return child

    def _wrap(self, method: str, handler: Any) -> Any:
        latency = self._child

        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary
            if not inspect.iscoroutinefunction(inner):
                return handler

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = time.perf_counter()
                rid = logs.accept_request_id(_caller_id(context))
                token = logs.request_id.set(rid)
                code = grpc.StatusCode.UNKNOWN
                try:
                    context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
                    response = await inner(request, context)
                    code = context.code() or grpc.StatusCode.OK
                    return response
                except grpc.aio.AbortError:
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                except BaseException:
                    # The error interceptor maps everything; this only happens for cancellations.
                    code = context.code() or grpc.StatusCode.CANCELLED
                    raise
                finally:
                    elapsed = time.perf_counter() - started
                    # After the answer is sent; the callback runs in a copy of this context, so its
                    # line carries the request id.
                    asyncio.get_running_loop().call_soon(
                        _finished, latency, method, code, context.cancelled(), elapsed, context.peer()
                    )
                    logs.request_id.reset(token)

            if handler.unary_unary is not None:
                return grpc.unary_unary_rpc_method_handler(
                    unary,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            return grpc.stream_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        streaming = handler.unary_stream or handler.stream_stream
        if inspect.isasyncgenfunction(streaming):

            async def generate(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                # Each RPC runs in its own task, so the id needs no reset (a generator may be
                # closed from another context, where a reset would fail).
                rid = logs.accept_request_id(_caller_id(context))
                logs.request_id.set(rid)
                peer = context.peer()  # now: a call the caller left may be gone by the finally below
                started = time.perf_counter()
                left = False
                try:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
                    async for response in streaming(request, context):
                        yield response
                except (GeneratorExit, asyncio.CancelledError):
                    left = True  # the caller stopped watching
                    raise
                finally:
                    _stream_ended(method, context.code(), left, time.perf_counter() - started, peer)

            behavior: Callable[..., Any] = generate
        elif inspect.iscoroutinefunction(streaming):

            async def write(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                rid = logs.accept_request_id(_caller_id(context))
                token = logs.request_id.set(rid)
                peer = context.peer()
                started = time.perf_counter()
                left = False
                try:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
                    return await streaming(request, context)
                except asyncio.CancelledError:
                    left = True
                    raise
                finally:
                    _stream_ended(method, context.code(), left, time.perf_counter() - started, peer)
                    logs.request_id.reset(token)

            behavior = write
        else:
            return handler  # synchronous handlers run in an executor; none are registered
        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream is not None
            else grpc.stream_stream_rpc_method_handler
        )
        return factory(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
