"""The operator page (server/page/): static files that need no token, since they hold no data. The page reads
GET /status, /versions and /receivers itself with the token the operator pastes (docs/security.md)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# path -> (file in server/page/, media type); only these paths skip the token check (LimitsAndAuth)
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/page/page.js": ("page.js", "text/javascript; charset=utf-8"),
              "/page/page.css": ("page.css", "text/css; charset=utf-8"),
              # docs/glossary.md, shipped with the package (tests/test_glossary.py keeps the two the same)
              "/page/glossary.md": ("glossary.md", "text/plain; charset=utf-8")}
# The page loads only its own files and talks only to its own daemon; nothing may frame it.
_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                       "connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                       "frame-ancestors 'none'",
            "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def add_page(app: FastAPI) -> None:
    folder = resources.files("ckpt_engine.server") / "page"
    for path, (name, media_type) in PAGE_FILES.items():
        body = (folder / name).read_bytes()  # read once: the files ship with the package and never change

        def serve(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        # HEAD too: LimitsAndAuth admits it for these paths, and a HEAD-only route check (a proxy's, a load
        # balancer's) should see the page's headers, not a 405 (uvicorn sends no body for a HEAD).
        app.add_api_route(path, serve, methods=["GET", "HEAD"], include_in_schema=False)


__all__ = ["PAGE_FILES", "add_page"]
