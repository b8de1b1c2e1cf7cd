"""HTTP authentication: each route declares the operation it serves as a FastAPI dependency.

``Depends(guard.requires("ApplyDeltas"))`` checks ``Authorization: Bearer <token>`` for that
operation's role (:data:`tally_server.auth.REQUIRED`), checks the checkpoint the path or query names
(or a writer handle's checkpoint) against the token's scopes, binds the caller for the call
(:func:`tally_server.auth.bind`) and hands it to the handler. A route whose checkpoint is in the JSON
body declares ``checkpoint_in_body=True`` and checks it once the body is read, with
``caller.require(operation, name)``: FastAPI would parse a declared body before any dependency, so
those routes read their bodies themselves (``bodies.py``) and nothing of the body is parsed for a
caller without the role.

:func:`create_app` refuses to build an app with a ``/v1`` route that declares no operation, and a
test walks the routes too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from tally_server import auth
from tally_server.auth import METRICS, Authorizer, Principal

__all__ = ["Guard", "Requires", "api_routes", "check_declared", "declared_operation"]


class Requires:
    """The dependency that lets a caller through to one operation (see the module docstring)."""

    def __init__(
        self,
        operation: str,
        authorizer: Authorizer,
        checkpoint_of: Callable[[str], str | None],
        *,
        checkpoint_in_body: bool = False,
    ) -> None:
        self.operation = operation
        self.checkpoint_in_body = checkpoint_in_body
        self._authorizer = authorizer
        self._checkpoint_of = checkpoint_of

    def check(self, request: Request) -> Principal:
        """The caller, allowed ``operation`` on the checkpoint the path or query names.

        Raises:
            Unauthenticated: no bearer token, or one this coordinator does not know (401).
            PermissionDenied: the token's role is too low, or the checkpoint outside its scopes (403).
        """
        principal = self._authorizer.check(self.operation, request.headers.get("authorization"))
        if not self.checkpoint_in_body:
            # As FastAPI reads them (the last of repeated query parameters wins), so the checkpoint
            # checked here is the one the handler gets.
            fields = dict(request.query_params.items())
            fields.update({k: str(v) for k, v in request.path_params.items()})
            principal.require_request(self.operation, fields, self._checkpoint_of)
        return principal

    async def __call__(self, request: Request) -> AsyncIterator[Principal]:
        """Authenticate the request and bind its principal while the route runs."""
        principal = self.check(request)
        with auth.bind(principal):
            yield principal

    def __repr__(self) -> str:
        return f"Requires({self.operation!r}{', checkpoint_in_body=True' if self.checkpoint_in_body else ''})"


class Guard:
    """Makes the :class:`Requires` dependencies of one app's routes, all checked by one authorizer."""

    def __init__(
        self, authorizer: Authorizer, checkpoint_of: Callable[[str], str | None], *, metrics_auth: bool
    ) -> None:
        """``checkpoint_of``: a writer handle's checkpoint (None if unknown), for scoped tokens."""
        self._authorizer = authorizer
        self._checkpoint_of = checkpoint_of
        self._metrics_auth = metrics_auth

    def requires(self, operation: str, *, checkpoint_in_body: bool = False) -> Requires:
        """The dependency of a route that serves ``operation`` (a tally.v1 RPC name)."""
        return Requires(
            operation, self._authorizer, self._checkpoint_of, checkpoint_in_body=checkpoint_in_body
        )

    async def metrics(self, request: Request) -> None:
        """``GET /metrics``: open, or with ``metrics_auth`` an unscoped grant (it names every checkpoint)."""
        if self._metrics_auth:
            principal = self._authorizer.check(METRICS, request.headers.get("authorization"))
            principal.require(METRICS, None)


def declared_operation(route: APIRoute) -> Requires | None:
    """The :class:`Requires` a route declares (None if it declares none)."""
    found = [d.call for d in route.dependant.dependencies if isinstance(d.call, Requires)]
    if len(found) > 1:
        raise ValueError(f"route {route.path} declares {len(found)} operations: {found}")
    return found[0] if found else None


def api_routes(routes: Iterable[BaseRoute]) -> Iterator[APIRoute]:
    """The FastAPI routes among ``routes`` (``app.routes``), those of included routers too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        # Recent FastAPI keeps an included router as one entry of app.routes.
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included.routes)


def check_declared(app: FastAPI) -> None:
    """Refuse an app with a ``/v1`` route that declares no operation (it would be open to anyone)."""
    for route in api_routes(app.routes):
        if route.path.startswith("/v1/") and declared_operation(route) is None:
            raise RuntimeError(
                f"route {sorted(route.methods or ())} {route.path} declares no operation: add "
                'Depends(guard.requires("<tally.v1 RPC>")) to it'
            )
