"""Error mapping at the gRPC edge: domain errors → status codes, undecodable requests → INVALID_ARGUMENT."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tally_server.errors import ErrorCode, TallyServerError

log = logging.getLogger(__name__)

DETAILS_KEY = "tally-error-details"

STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message (e.g. non-UTF-8 strings)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        assert deserializer is not None
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return deserialize


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Maps ``TallyServerError`` to its status code; anything else is logged and becomes INTERNAL."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = details.method

        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request to {method} could not be decoded ({request.error}); strings must be valid "
                    "UTF-8 and the message must match tally.v1",
                )
            try:
                return await inner(request, context)
            except TallyServerError as exc:
                if exc.details:
                    # The SDK reads these back into TallyError.details (HTTP carries them in the body).
                    context.set_trailing_metadata(((DETAILS_KEY, json.dumps(exc.details, default=str)),))
                await context.abort(STATUS[exc.code], exc.message)
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("unhandled error in %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log")

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=_safe(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
