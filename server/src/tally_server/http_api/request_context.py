"""Pure-ASGI middleware: a request id for every HTTP request, and its latency by route template.

The id comes from the ``X-Request-ID`` header (or is made up), is set in
:data:`tally_server.logs.request_id` for every log line the request causes, and is echoed as the
``X-Request-ID`` response header.

Latency is labelled with the matched route's template (``/v1/writers/{handle}/deltas``), never the
raw path: handles and checkpoint names in paths would make the label set unbounded. Event streams
(``text/event-stream``, e.g. ``/v1/watch``) are not timed, like gRPC streams: their duration is how
long someone watched.

Every request gets an access line (:func:`tally_server.logs.access`) when it ends; the routes in
:data:`QUIET_ROUTES` only at DEBUG unless they fail.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tally_server import logs

REQUEST_ID_HEADER = b"x-request-id"
UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Polled by machines every few seconds per writer or scraper: access lines at DEBUG.
QUIET_ROUTES = frozenset(
    {"/healthz", "/readyz", "/metrics", "/v1/writers/{handle}/keepalive", "/ui/{name:path}"}
)


def route_template(scope: Scope) -> str:
    """The path template of the route that handled (or would handle) the request."""
    route = scope.get("route")
    if route is None:
        # Answered before routing (e.g. the body limit): find the route it was meant for.
        app = scope.get("app")
        routes: list[BaseRoute] = getattr(app, "routes", [])
        for candidate in routes:
            match, _ = candidate.matches(scope)
            if match != Match.NONE:
                route = candidate
                break
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class RequestMiddleware:
    """Sets the request id and observes ``tally_http_request_duration_seconds{method, route, status}``."""

    def __init__(self, app: ASGIApp, latency: Histogram) -> None:
        self.app = app
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Bind a request id to the request and time it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = None
        for key, value in scope["headers"]:
            if key == REQUEST_ID_HEADER:
                incoming = value.decode("latin-1")
                break
        rid = logs.accept_request_id(incoming)
        token = logs.request_id.set(rid)
        status = 500
        failed = False
        event_stream = False
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status, event_stream
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", ()):
                    if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                        event_stream = True
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            # Left set on purpose: Starlette's catch-all error handler runs outside this middleware,
            # in the same task, and its traceback line should carry the id too. uvicorn gives every
            # request its own task, so it goes no further.
            failed = True
            raise
        finally:
            elapsed = time.perf_counter() - started
            route = route_template(scope)
            if not event_stream:
                method = scope["method"] if scope["method"] in _METHODS else "other"
                self.latency.labels(method, route, str(status)).observe(elapsed)
            client = scope.get("client")
            logs.access(
                "http",
                scope["method"],
                status,
                elapsed,
                f"{client[0]}:{client[1]}" if client else None,
                path=scope["path"],
                quiet=route in QUIET_ROUTES,
                ok=status < 400,
            )
            if not failed:
                logs.request_id.reset(token)
