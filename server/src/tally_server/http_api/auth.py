"""HTTP authentication: ``Authorization: Bearer <token>`` checked for the operation a route serves.

The role is checked from the header; the checkpoint named in the path or query (or a writer
handle's checkpoint) is checked against the token's scopes here, and the caller is bound
(:func:`tally_server.auth.bind`) for the handler. Routes that name their checkpoint in the JSON
body (:data:`BODY_CHECKED`) check it in the handler, with ``auth.current().require``.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import QueryParams
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from tally_server import auth
from tally_server.auth import METRICS, Authorizer
from tally_server.errors import TallyServerError
from tally_server.http_api.errors import HTTP_STATUS, error_response

# Route function name (see http_api/app.py) → tally.v1 operation, for the role table in auth.py.
OPERATIONS: dict[str, str] = {
    "open_writer": "OpenWriter",
    "keep_alive": "KeepAlive",
    "apply_deltas": "ApplyDeltas",
    "flush": "Flush",
    "close_writer": "CloseWriter",
    "are_completed": "AreCompleted",
    "list_checkpoints": "ListCheckpoints",
    "get_checkpoint": "GetCheckpoint",
    "list_writers": "ListWriters",
    "list_events": "ListEvents",
    "progress": "GetProgress",
    "watch": "WatchCheckpoint",
    "list_completed": "ListCompleted",
    "import_completed": "ImportCompleted",
    "reset": "ResetCheckpoint",
}

#: Operations whose checkpoint is in the JSON body: their handlers check it against the caller.
BODY_CHECKED = frozenset({"OpenWriter", "AreCompleted", "ImportCompleted", "ResetCheckpoint"})


class AuthMiddleware:
    """Checks /v1 routes (and /metrics with ``metrics_auth``); health, OpenAPI and the dashboard's
    static files stay open."""

    def __init__(
        self,
        app: ASGIApp,
        authorizer: Authorizer,
        checkpoint_of: Callable[[str], str | None],
        metrics_auth: bool = False,
    ) -> None:
        self.app = app
        self.authorizer = authorizer
        self.checkpoint_of = checkpoint_of
        self.metrics_auth = metrics_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        fields: dict[str, str] = {}
        operation = None
        if path.startswith("/v1/"):
            operation, fields = self._operation(scope)
        elif path == "/metrics" and self.metrics_auth:
            operation = METRICS
        if operation is None:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
        try:
            principal = self.authorizer.check(operation, header)
            if operation == METRICS:
                principal.require(METRICS, None)  # the exposition names every checkpoint
            elif operation not in BODY_CHECKED:
                principal.require_request(operation, fields, self.checkpoint_of)
        except TallyServerError as exc:
            response = error_response(HTTP_STATUS[exc.code], exc.code, exc.message, exc.details)
            await response(scope, receive, send)
            return
        with auth.bind(principal):
            await self.app(scope, receive, send)

    def _operation(self, scope: Scope) -> tuple[str | None, dict[str, str]]:
        """The operation the route serves and the request's path and query parameters."""
        app = scope.get("app")
        for route in getattr(getattr(app, "router", None), "routes", ()):
            match, child = route.matches(scope)
            if match is Match.FULL:
                # Parsed as FastAPI parses them (the last of repeated query parameters wins), so
                # the checkpoint checked here is the one the handler gets.
                fields = dict(QueryParams(scope.get("query_string", b"")).items())
                fields.update({k: str(v) for k, v in child.get("path_params", {}).items()})
                return OPERATIONS.get(getattr(route, "name", ""), "admin-only"), fields
        return None, {}
