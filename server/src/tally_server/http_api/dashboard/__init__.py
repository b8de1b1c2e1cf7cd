"""The dashboard: a single-page app served by Tally itself (no CDN, no build step; clusters are air-gapped).

``GET /`` is the page; ``GET /ui/<asset>`` its script and stylesheet, read from this package with
``importlib.resources`` so an installed wheel serves them too. The page reads the ``/v1`` JSON API.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

# Only these files are served; anything else under /ui/ is a 404.
_ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

# Everything comes from this server: no inline script, no third-party origin, no framing.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate on every load (cheap: ETag), so an upgraded server never runs a stale script.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def _asset(name: str, media_type: str) -> _Asset:
    body = resources.files(__name__).joinpath(name).read_bytes()
    return _Asset(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')


def _serve(request: Request, asset: _Asset) -> Response:
    headers = {**_HEADERS, "ETag": asset.etag}
    if asset.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


def build_router() -> APIRouter:
    """``GET /`` (the page) and ``GET /ui/{asset}``; kept out of the OpenAPI schema."""
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def index(request: Request) -> Response:
        return _serve(request, _asset("index.html", "text/html; charset=utf-8"))

    @router.get("/ui/{name}")
    async def asset(name: str, request: Request) -> Response:
        media_type = _ASSETS.get(name)
        if media_type is None:
            raise HTTPException(status_code=404, detail="Not Found")
        return _serve(request, _asset(name, media_type))

    return router
