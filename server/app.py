"""The HTTP server: OpenAI-compatible routes over an engine client (`engine.types.EngineClient`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /ready, GET /metrics, GET /version, OpenAPI docs at /docs. With an API key, the /v1 routes
need `Authorization: Bearer <key>`; /health, /ready, /metrics and /docs stay public.

Importing this module loads no torch: the engine is reached only through its torch-free
contract (`engine.types`, `engine.params`, `engine.validation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from server.routes import VERSION, ops_router, v1_router
from server.state import ServerState

__all__ = ["ServerState", "create_app"]


# A client's x-request-id: echoed into headers and logs, so bounded and plain.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BAD_REQUEST_ID = APIError(
    400,
    "x-request-id must be 1 to 128 characters of letters, digits and . _ : -",
    "x-request-id",
)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.engine.shutdown()

    app = FastAPI(
        title="Canvas",
        version=VERSION,
        description="OpenAI-compatible block-diffusion LLM server",
        lifespan=lifespan,
    )
    app.state.canvas = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    state.engine.on_step.append(state.metrics.on_step)

    @app.middleware("http")
    async def _edge(request: Request, call_next: Any) -> Response:
        """Request ids, body-size limit (413) and API key (401) before any route runs. The
        client's `x-request-id` (validated) is only echoed and logged; the engine keys every
        request by `response_key`, which the server makes unique."""
        client_id = request.headers.get("x-request-id")
        valid = client_id is None or REQUEST_ID.fullmatch(client_id) is not None
        request_id = client_id if client_id is not None and valid else uuid.uuid4().hex
        request.state.request_id = request_id
        request.state.response_key = uuid.uuid4().hex
        error = _refusal(state, request) if valid else _BAD_REQUEST_ID
        if error is not None:
            headers = {"x-request-id": request_id}
            return JSONResponse(error.body(), status_code=error.status, headers=headers)
        response = await call_next(request)
        response.headers["x-request-id"] = request_id
        return response

    app.include_router(ops_router(state))
    app.include_router(v1_router(state))
    return app


def _refusal(state: ServerState, request: Request) -> APIError | None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
        return APIError(
            413, f"Request body of {length} bytes exceeds the limit of {state.max_body_bytes}"
        )
    if (
        state.api_key
        and request.url.path.startswith("/v1/")
        and not _authorized(request, state.api_key)
    ):
        return APIError(401, "Invalid or missing API key (send Authorization: Bearer <key>)")
    return None


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), key.encode())
