"""gRPC authentication: the bearer token in the ``authorization`` metadata, checked per RPC.

The role is checked from the metadata alone, before the request is decoded; the checkpoint a
request names (or its writer handle's checkpoint) is checked against the token's scopes once it is
decoded, and the caller is bound (:func:`tally_server.auth.bind`) for the handler. Refusals are
raised as :class:`~tally_server.errors.TallyServerError`: the error interceptor around this one
turns them into status codes, like every other refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from tally_server import auth
from tally_server.auth import Authorizer, Principal
from tally_server.errors import TallyServerError
from tally_server.grpc_api.columns import ColumnsRequest

_PREFIX = "/tally.v1.Coordinator/"
# Request fields that name a checkpoint or a writer handle (see auth.CHECKPOINT_FIELD).
_FIELDS = ("checkpoint", "name", "handle")


def _refusal(handler: Any, exc: TallyServerError) -> Any:
    """A handler of the same kind as ``handler`` that refuses with ``exc``, never decoding the request."""

    async def unary(request: bytes, context: Any) -> Any:
        raise exc

    async def stream(request: bytes, context: Any) -> AsyncIterator[Any]:
        raise exc
        yield  # pragma: no cover - makes this an async generator

    if handler is not None and handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary)


def _fields(request: object) -> dict[str, str]:
    """The fields a scoped token's check reads; none for a request of another kind (fail closed)."""
    if isinstance(request, Message):
        return {f: getattr(request, f) for f in _FIELDS if f in request.DESCRIPTOR.fields_by_name}
    if isinstance(request, ColumnsRequest):  # ApplyDeltas read by the compiled core
        return {"handle": request.handle}
    # Names no checkpoint: only unscoped grants pass (require_request).
    return {}


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks tally.v1 calls only; health checking and reflection stay open for probes and tools.

    Put it inside the error interceptor, which maps its refusals to status codes. Without tokens
    (authentication off) every caller is the same, so each method's handler is wrapped once.
    """

    def __init__(self, authorizer: Authorizer, checkpoint_of: Callable[[str], str | None]) -> None:
        """``checkpoint_of``: a writer handle's checkpoint (None if unknown), for scoped tokens."""
        self._authorizer = authorizer
        self._checkpoint_of = checkpoint_of
        self._open: dict[str, tuple[Any, Any]] = {}  # authentication off: method -> (handler, wrapped)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """Wrap each method's handler so it checks the caller's role before decoding the request."""
        method: str = details.method
        if not method.startswith(_PREFIX):
            return await continuation(details)
        operation = method[len(_PREFIX) :]
        if not self._authorizer.enabled:
            handler = await continuation(details)
            if handler is None:
                return None
            cached = self._open.get(method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            wrapped = self._scoped(handler, operation, auth.UNRESTRICTED)
            self._open[method] = (handler, wrapped)
            return wrapped
        header = dict(details.invocation_metadata or ()).get("authorization")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        return self.guard(operation, header, await continuation(details))

    def guard(self, operation: str, header: str | None, handler: Any) -> Any:
        """``handler`` of ``operation`` behind the checks of the caller's ``authorization`` header."""
        try:
            principal = self._authorizer.check(operation, header)
        except TallyServerError as exc:
            return _refusal(handler, exc)
        if handler is None:
            return None
        return self._scoped(handler, operation, principal)

    def _scoped(self, handler: Any, operation: str, principal: Principal) -> Any:
        scoped = principal is not auth.UNRESTRICTED  # else every request passes: nothing to check

        def check(request: Any) -> None:
            # (An undecodable request never gets here: the error interceptor outside refuses it.)
            if scoped:
                principal.require_request(operation, _fields(request), self._checkpoint_of)

        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                if scoped:
                    check(request)
                with auth.bind(principal):
                    return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            # Not bound: no stream handler reads the caller, and a context variable set inside an
            # async generator cannot be reset safely when grpc closes it from elsewhere.
            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                check(request)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # no client-streaming RPCs in tally.v1
