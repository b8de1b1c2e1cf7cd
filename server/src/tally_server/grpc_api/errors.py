"""Error mapping at the gRPC edge: domain errors → status codes, undecodable requests → INVALID_ARGUMENT.

The one place where a refusal becomes a status: the handlers and the interceptors inside this one
(authentication) raise :class:`~tally_server.errors.TallyServerError` and this interceptor answers it.

Every refusal carries the standard ``grpc-status-details-bin`` (a ``google.rpc.Status`` with
ErrorInfo, and BadRequest naming the field of an invalid argument) and, when it has details, their
JSON in ``tally-error-details`` for the SDK: see :mod:`~tally_server.grpc_api.status_details`, which
also keeps them within a peer's metadata limit.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tally_server.errors import STORAGE_ERRORS, InvalidArgument, TallyServerError, storage_unavailable
from tally_server.grpc_api.status_details import refusal
from tally_server.grpc_api.wrapping import WrappingInterceptor

log = logging.getLogger(__name__)


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message (e.g. non-UTF-8 strings)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None  # the handler takes the raw bytes (e.g. a refusal that never decodes them)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return deserialize


async def _abort(context: Any, exc: TallyServerError) -> None:
    code, message, trailers = refusal(exc.code, exc.message, exc.details)
    # Kept beside what is set already (the request id of a unary call).
    kept = tuple(context.trailing_metadata() or ())
    context.set_trailing_metadata((*kept, *trailers))
    await context.abort(code, message)


async def _failed(context: Any, method: str, exc: Exception) -> None:
    """Answer what a handler raised with the status it maps to.

    A refusal gets its code, a storage error UNAVAILABLE (the caller may retry), anything else
    INTERNAL; the last two are logged with their traceback.
    """
    if isinstance(exc, TallyServerError):
        await _abort(context, exc)
    elif isinstance(exc, STORAGE_ERRORS):
        log.error("storage error in %s, answered UNAVAILABLE", method, exc_info=exc)
        await _abort(context, storage_unavailable(exc))
    else:
        log.error("unhandled error in %s", method, exc_info=exc)
        await _abort(context, TallyServerError(f"internal error in {method}; see server log"))


async def _refuse_undecodable(context: Any, method: str, request: _Undecodable) -> None:
    refused = InvalidArgument(
        f"request to {method} could not be decoded ({request.error}); strings must be valid "
        "UTF-8 and the message must match tally.v1"
    )
    await _abort(context, refused)


class ErrorInterceptor(WrappingInterceptor):
    """Maps ``TallyServerError`` to its status code and a storage error to UNAVAILABLE.

    Anything else is logged and becomes INTERNAL.

    Covers unary calls and server streams (WatchCheckpoint) alike: a request that cannot be decoded
    is INVALID_ARGUMENT, and a refusal in the middle of a stream ends it with the refusal's code.
    Client-streaming methods (none in tally.v1) pass through untouched. A method's handler is
    wrapped once and the wrapper reused while the handler inside stays the same.
    """

    def _wrap(self, method: str, handler: Any) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                request_deserializer=_safe(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                request_deserializer=_safe(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler

    @staticmethod
    def _unary(inner: Callable[..., Any], method: str) -> Callable[..., Any]:
        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse_undecodable(context, method, request)
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _failed(context, method, exc)

        return unary

    @staticmethod
    def _stream(inner: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(inner):

            async def generate(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await _refuse_undecodable(context, method, request)
                try:
                    async for response in inner(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _failed(context, method, exc)

            return generate
        # Streams that answer through context.write() (grpc's health Watch) are awaited like a
        # unary call.
        return ErrorInterceptor._unary(inner, method)
