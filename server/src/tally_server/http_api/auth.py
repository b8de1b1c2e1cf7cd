"""HTTP authentication: ``Authorization: Bearer <token>`` checked for the operation a route serves."""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from tally_server.auth import Authorizer
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


class AuthMiddleware:
    """Checks /v1 routes; health, metrics, OpenAPI and the dashboard's static files stay open."""

    def __init__(self, app: ASGIApp, authorizer: Authorizer) -> None:
        self.app = app
        self.authorizer = authorizer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.authorizer.enabled and scope["path"].startswith("/v1/"):
            operation = self._operation(scope)
            if operation is not None:
                header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
                try:
                    self.authorizer.check(operation, header)
                except TallyServerError as exc:
                    await error_response(HTTP_STATUS[exc.code], exc.code, exc.message)(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _operation(self, scope: Scope) -> str | None:
        app = scope.get("app")
        for route in getattr(getattr(app, "router", None), "routes", ()):
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return OPERATIONS.get(getattr(route, "name", ""), "admin-only")
        return None
