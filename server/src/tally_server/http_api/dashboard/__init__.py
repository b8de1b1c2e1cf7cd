"""The dashboard: a single-page app served by Tally itself (no CDN, no build step; clusters are air-gapped).

``GET /`` is the page; ``GET /ui/<path>`` its stylesheet and its scripts (native ES modules, ``app.js``
importing the others by relative path), read from this package with ``importlib.resources`` so an
installed wheel serves them too. The page reads the ``/v1`` JSON API and its watch stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import PurePosixPath

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

# Only the package's scripts and stylesheets are served; anything else under /ui/ is a 404.
_MEDIA_TYPES: dict[str, str] = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
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
def _assets() -> dict[str, str]:
    """Media type of every servable file, by its path under ``/ui/`` (``app.js``, ``views/list.js``)."""
    found: dict[str, str] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for child in folder.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif (media_type := _MEDIA_TYPES.get(PurePosixPath(child.name).suffix)) is not None:
                found[prefix + child.name] = media_type

    walk(resources.files(__name__), "")
    return found


@cache
def _asset(name: str, media_type: str) -> _Asset:
    body = resources.files(__name__).joinpath(*name.split("/")).read_bytes()
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

    @router.get("/ui/{name:path}")
    async def asset(name: str, request: Request) -> Response:
        media_type = _assets().get(name)
        if media_type is None:
            raise HTTPException(status_code=404, detail="Not Found")
        return _serve(request, _asset(name, media_type))

    return router
