"""The API reference pages, /docs (Swagger UI) and /redoc (ReDoc), in process.

The browser test in tests/integration/test_dashboard.py renders them in Chromium, offline.
"""

from __future__ import annotations

import re

import pytest

from tests.unit.http_api.conftest import InProcess


@pytest.mark.anyio
async def test_the_api_reference_is_served_by_the_coordinator(served: InProcess) -> None:
    """/docs and /redoc load everything from this server (the browser test renders them)."""
    http = served.http
    for page in ("/docs", "/redoc"):
        reply = await http.get(page)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
        assert "script-src 'self';" in reply.headers["content-security-policy"]
        # Only relative URLs: nothing from a CDN, and the pages work under a proxy's path prefix.
        urls = re.findall(r'(?:src|href|spec-url)="([^"]+)"', reply.text)
        assert urls and not [u for u in urls if "//" in u or u.startswith("/")], urls
        for url in urls:
            assert (await http.get("/" + url)).status_code == 200, url
    script = await http.get("/docs/assets/swagger-ui-bundle.js")
    assert script.headers["content-type"].startswith("text/javascript") and len(script.content) > 100_000
    again = await http.get(
        "/docs/assets/swagger-ui-bundle.js", headers={"If-None-Match": script.headers["etag"]}
    )
    assert again.status_code == 304
    for missing in ("/docs/assets/nope.js", "/docs/assets/__init__.py", "/docs/assets/..%2Fconsts.py"):
        assert (await http.get(missing)).status_code == 404, missing
    paths = (await http.get("/openapi.json")).json()["paths"]
    assert not [p for p in paths if p.startswith(("/docs", "/redoc"))]
