"""What the gRPC edge's interceptors share: each method's handler wrapped once, not per call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """An interceptor that wraps each method's handler (``_wrap``) and reuses the wrapper.

    A wrapper is kept per method while the handler inside stays the same object (the servicer's
    are made once; a replica's are made per call, and then wrapped per call). Unknown methods
    (no handler) pass through, so the cache holds only the service's own method names.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """The wrapped handler of the call's method (None for an unknown method: UNIMPLEMENTED)."""
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
        raise NotImplementedError
