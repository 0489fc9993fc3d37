"""The HTTP server: OpenAI-compatible routes over an engine client (`engine.types.EngineClient`).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models,
POST /tokenize, POST /detokenize, POST /reset_prefix_cache, GET /health, GET /ready, GET and
POST /ping, GET /load, GET /metrics, GET /version, OpenAPI docs at /docs, and the playground page
at / and /playground (`server.playground`). With an API key, every request needs
`Authorization: Bearer <key>` except those routed to the public routes: /health, /ready, /ping,
/load, /metrics, /version, the OpenAPI docs and the page (a path that matches no route needs
the key too). The edge of every request (ids, limits, auth, body, last-resort errors) is
`server.edge`; with a CORS policy (`ServerState.cors`) Starlette's CORS middleware runs before
it, so a browser's preflight (which carries no key) is answered there.

Importing this module loads no torch: the engine is reached only through its torch-free
contract (`engine.types`, `engine.params`, `engine.validation`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.edge import EdgeMiddleware, RouteAccess
from server.errors import (
    APIError,
    ClientGone,
    api_error_handler,
    client_gone_handler,
    http_error_handler,
    validation_error_handler,
)
from server.metrics import HttpMetricsMiddleware
from server.playground import playground_router
from server.responses import responses_router
from server.routes import VERSION, admin_router, ops_router, v1_router
from server.state import ServerState
from server.tokenize import tokenize_router

__all__ = ["ServerState", "create_app"]


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
    app.add_exception_handler(ClientGone, client_gone_handler)
    state.engine.on_step.append(state.metrics.on_step)

    app.include_router(ops_router(state))
    app.include_router(playground_router())
    public = tuple(app.routes)  # the OpenAPI docs, health/ready/metrics/version, the page
    app.include_router(v1_router(state))
    app.include_router(responses_router(state))
    app.include_router(tokenize_router(state))
    app.include_router(admin_router(state))
    app.add_middleware(EdgeMiddleware, state=state, access=RouteAccess(app.routes, public))
    if (cors := state.cors) is not None:  # outside the edge: a preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.origins,
            allow_methods=cors.methods,
            allow_headers=cors.headers,
            allow_credentials=cors.credentials,
            expose_headers=["x-request-id"],
        )
    # Outermost: it counts CORS preflights and the edge's refusals too.
    app.add_middleware(HttpMetricsMiddleware, metrics=state.metrics.http)
    return app
