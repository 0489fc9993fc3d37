"""The playground: a chat page that draws each canvas denoising, served at `/` and `/playground`.

Static files (`server/static/`: plain HTML, CSS and JavaScript, no build step, nothing loaded
from elsewhere), read once when the router is made. The page itself is public; its script sends
the API key the user types as `Authorization: Bearer` to the /v1 routes, which check it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from server.errors import APIError

# Everything the page loads comes from this server; no inline script or style.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "content-security-policy": _CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
}


def playground_router() -> APIRouter:
    static = resources.files("server") / "static"
    files = {name: (static / name).read_bytes() for name in _TYPES}
    router = APIRouter(include_in_schema=False)

    def serve(name: str) -> Response:
        return Response(files[name], media_type=_TYPES[name], headers=_HEADERS)

    @router.get("/")
    async def root() -> Response:
        return serve("index.html")

    @router.get("/playground")
    async def page() -> Response:
        return serve("index.html")

    @router.get("/playground/{name}")
    async def asset(name: str) -> Response:
        if name not in files or name == "index.html":
            raise APIError(404, "Not found: no such route")
        return serve(name)

    return router
