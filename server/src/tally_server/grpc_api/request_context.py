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
the methods in :data:`QUIET_METHODS` only at DEBUG unless they fail.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from tally_server import logs

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


def _access(
    method: str, code: grpc.StatusCode, elapsed: float, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    if code == grpc.StatusCode.OK and context.cancelled():
        code = grpc.StatusCode.CANCELLED  # the caller left (a watcher stopped watching)
    ok = code == grpc.StatusCode.OK
    logs.access("grpc", method, code.name, elapsed, context.peer(), quiet=method in QUIET_METHODS, ok=ok)


class RequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Request ids for all calls; ``tally_grpc_request_duration_seconds{method, code}`` for unary ones.

    Put it first in the interceptor list so it wraps the error interceptor and sees the final code.
    """

    def __init__(self, latency: Histogram) -> None:
        self._latency = latency

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """Wrap each handler to bind a request id and time the call."""
        handler = await continuation(details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED; no label for arbitrary names
        method = details.method
        caller_id = _incoming_id(details.invocation_metadata)
        latency = self._latency

        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary
            if not inspect.iscoroutinefunction(inner):
                return handler

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                rid = logs.accept_request_id(caller_id)
                token = logs.request_id.set(rid)
                started = time.perf_counter()
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
                    latency.labels(method, code.name).observe(elapsed)
                    _access(method, code, elapsed, context)
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
                rid = logs.accept_request_id(caller_id)
                logs.request_id.set(rid)
                started = time.perf_counter()
                try:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
                    async for response in streaming(request, context):
                        yield response
                finally:
                    _access(
                        method, context.code() or grpc.StatusCode.OK, time.perf_counter() - started, context
                    )

            behavior: Callable[..., Any] = generate
        elif inspect.iscoroutinefunction(streaming):

            async def write(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                rid = logs.accept_request_id(caller_id)
                token = logs.request_id.set(rid)
                started = time.perf_counter()
                try:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
                    return await streaming(request, context)
                finally:
                    _access(
                        method, context.code() or grpc.StatusCode.OK, time.perf_counter() - started, context
                    )
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
