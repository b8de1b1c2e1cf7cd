"""Pure-ASGI middleware that refuses a request body over ``max_message_bytes`` (413)."""

from __future__ import annotations

from typing import NoReturn

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tally_server.errors import ErrorCode
from tally_server.http_api.errors import error_response


class _BodyTooLarge(Exception):
    """Raised into the app by BodyLimit's receive once the body passed the limit (the 413 is sent)."""


class BodyLimit:
    """Refuses a request body over the limit without holding more of it than the limit.

    The limit applies when the app reads the body, that is after the route's role check: a caller
    without the right token is refused as such (401/403), whatever the size of its body. A declared
    Content-Length over the limit is refused at the first read, before a byte is read. A body without
    one (``Transfer-Encoding: chunked``) is counted as it arrives and refused as soon as it passes the
    limit; the server discards the rest as it comes in.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _refusal(self, size: str) -> JSONResponse:
        message = (
            f"request body is {size} bytes, over the limit of {self.limit} (setting max_message_bytes); "
            "send smaller batches"
        )
        return error_response(413, ErrorCode.RESOURCE_EXHAUSTED, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a body larger than the limit (413) before the route reads it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        announced = int(declared) if declared.isdigit() else 0
        received = 0
        started = refused = False

        async def refuse(size: str) -> NoReturn:
            nonlocal refused
            if not started and not refused:
                refused = True
                await self._refusal(size)(scope, receive, send)
            raise _BodyTooLarge

        async def counted_receive() -> Message:
            nonlocal received
            if announced > self.limit:
                await refuse(str(announced))
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    await refuse(f"more than {self.limit}")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # whatever the app makes of the aborted read: the 413 is the answer
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _BodyTooLarge:
            pass
