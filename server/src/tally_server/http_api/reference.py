"""The API reference pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served without a CDN.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on an air-gapped cluster they were blank.
These serve the same tools from the ``fastapi-offline`` package's copies (a dependency of the server)
under ``/docs/assets/``, with a start script of our own instead of an inline one, so the pages keep a
strict Content-Security-Policy like the dashboard's. Both read ``/openapi.json``; URLs are relative,
so the pages work behind a reverse proxy that serves Tally under a path prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

__all__ = ["ASSETS_PACKAGE", "build_router"]

#: The package whose ``static/`` folder holds Swagger UI's and ReDoc's built files.
ASSETS_PACKAGE = "fastapi_offline"

_SWAGGER_INIT = b"""// Starts Swagger UI on /openapi.json (a file: the page's CSP allows no inline script).
window.ui = SwaggerUIBundle({
  url: new URL("openapi.json", document.baseURI).href,
  dom_id: "#swagger-ui",
  deepLinking: true,
  displayOperationId: true,  // the tally.v1 RPC names: the same as over gRPC
  validatorUrl: null,  // its default badge asks a public validator about the spec
  persistAuthorization: false,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  layout: "BaseLayout",
});
"""

_DOCS_PAGE = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tally coordinator - API reference</title>
<link rel="icon" href="docs/assets/favicon.png">
<link rel="stylesheet" href="docs/assets/swagger-ui.css">
</head>
<body>
<noscript>This page needs JavaScript. The OpenAPI document itself is at
<a href="openapi.json">/openapi.json</a>.</noscript>
<div id="swagger-ui"></div>
<script src="docs/assets/swagger-ui-bundle.js"></script>
<script src="docs/assets/swagger-init.js"></script>
</body>
</html>
"""

_REDOC_PAGE = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tally coordinator - API reference (ReDoc)</title>
<link rel="icon" href="docs/assets/favicon.png">
</head>
<body>
<noscript>This page needs JavaScript. The OpenAPI document itself is at
<a href="openapi.json">/openapi.json</a>.</noscript>
<redoc spec-url="openapi.json"></redoc>
<script src="docs/assets/redoc.standalone.js"></script>
</body>
</html>
"""

# Everything from this server. Both tools set styles from script (style-src 'unsafe-inline'), and
# ReDoc runs its search index in a worker it makes from a blob.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated by ETag: an upgraded server never serves a stale copy
}
# The files of ASSETS_PACKAGE's static/ folder that the pages use, by name under /docs/assets/.
_PACKAGED: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    etag: str


def _file(body: bytes, media_type: str) -> _File:
    return _File(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')


@cache
def _asset(name: str) -> _File:
    if name == "swagger-init.js":
        return _file(_SWAGGER_INIT, "text/javascript; charset=utf-8")
    media_type = _PACKAGED.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail="Not Found")
    return _file(resources.files(ASSETS_PACKAGE).joinpath("static", name).read_bytes(), media_type)


def _serve(request: Request, file: _File) -> Response:
    headers = {**_HEADERS, "ETag": file.etag}
    if file.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.media_type, headers=headers)


def build_router() -> APIRouter:
    """``GET /docs``, ``GET /redoc`` and ``GET /docs/assets/{name}``; kept out of the OpenAPI schema."""
    router = APIRouter(include_in_schema=False)
    docs_page = _file(_DOCS_PAGE, "text/html; charset=utf-8")
    redoc_page = _file(_REDOC_PAGE, "text/html; charset=utf-8")

    @router.get("/docs")
    async def docs(request: Request) -> Response:
        return _serve(request, docs_page)

    @router.get("/redoc")
    async def redoc(request: Request) -> Response:
        return _serve(request, redoc_page)

    @router.get("/docs/assets/{name}")
    async def asset(name: str, request: Request) -> Response:
        return _serve(request, _asset(name))

    return router
