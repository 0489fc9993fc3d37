"""The edge of every HTTP request, as a plain ASGI middleware: request ids, head limits, the
API key, the body (read here, within its size and time limits), and the last word on errors.

The API key is required of every request except those the router would send to a public route
(`RouteAccess`): the decision is the router's own match on the same scope, so no spelling of a
path (`//v1/...`, `%2F`, `/./`, `..`, case, a trailing slash) and no `Host` or `X-Forwarded-*`
header reaches a keyed route without the key, and a path that matches no route needs it too.

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: the route sees the
server's own `receive`, so `Request.is_disconnected()` notices a client that went away and the
request is aborted. The body is read here once, bounded as it arrives (a chunked body counts
too), then replayed to the route.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.logs import REQUEST_ID
from server.state import ServerState

logger = logging.getLogger(__name__)

# A client's x-request-id: echoed into headers and logs, so bounded and plain.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BAD_REQUEST_ID = APIError(
    400,
    "x-request-id must be 1 to 128 characters of letters, digits and . _ : -",
    "x-request-id",
)
_CLOSE = {"connection": "close"}  # the rest of the body is not read: end the connection


@dataclass(frozen=True, slots=True)
class RouteAccess:
    """Which requests need the API key: every one but those the router dispatches to one of
    the `public` routes. `routes` is the router's live list, in dispatch order; a route is
    public by identity, so a route added later needs the key unless it is listed here."""

    routes: list[BaseRoute]
    public: tuple[BaseRoute, ...]

    def needs_key(self, scope: Scope) -> bool:
        for route in self.routes:  # as Starlette's router dispatches: the first full match
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return not any(route is p for p in self.public)
        return True  # no route (404), a wrong method (405) or a slash redirect: keyed too


class EdgeMiddleware:
    """Runs before any route: refuses bad request ids (400), too many or too large header
    fields (431), a declared body over the limit (413) and a missing API key (401) unless
    `access` says the request is public;
    reads the body (413 past the limit, 408 when it is late); echoes `x-request-id`; turns an
    unexpected exception into a 500 in the OpenAI envelope naming the request id.

    Sets `request.state.request_id` (the client's valid id, or a new one; only echoed and
    logged) and `request.state.response_key` (unique, made here: the engine keys requests by
    it)."""

    def __init__(self, app: ASGIApp, state: ServerState, access: RouteAccess) -> None:
        self.app = app
        self.state = state
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        client_id = headers.get("x-request-id")
        valid = client_id is None or CLIENT_REQUEST_ID.fullmatch(client_id) is not None
        request_id = client_id if client_id is not None and valid else uuid.uuid4().hex
        scope.setdefault("state", {}).update(request_id=request_id, response_key=uuid.uuid4().hex)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = [(b"x-request-id", request_id.encode())]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        async def refuse(error: APIError) -> None:
            response = JSONResponse(error.body(), error.status, headers=error.headers)
            await response(scope, receive, send_with_id)

        error = self._refusal(scope, headers) if valid else _BAD_REQUEST_ID
        if error is None:
            body, error = await self._read_body(receive)
            if body is None and error is None:
                return  # the client left while sending its body
            if body and (lenient := self.state.unknown_params) is not None:
                body = lenient.strip(scope["path"], body)
            receive = _replay(body or b"", receive)
        if error is not None:
            await refuse(error)
            return
        token = REQUEST_ID.set(request_id)  # the JSON log lines of this request carry it
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s failed", request_id)
            if started:
                raise
            await refuse(APIError(500, f"Internal error for request {request_id}"))
        finally:
            REQUEST_ID.reset(token)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        limits = self.state.http
        if len(scope["headers"]) > limits.max_header_count:
            return APIError(
                431, f"More than {limits.max_header_count} header fields", headers=_CLOSE
            )
        # h11 bounds a head still arriving; this bounds one that arrived whole.
        if sum(len(k) + len(v) for k, v in scope["headers"]) > limits.max_header_bytes:
            return APIError(
                431, f"The header fields exceed {limits.max_header_bytes} bytes", headers=_CLOSE
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            return _too_large(limits.max_body_bytes)
        keys = self.state.api_keys
        if keys and self.access.needs_key(scope) and not _authorized(headers, keys):
            return APIError(401, "Invalid or missing API key (send Authorization: Bearer <key>)")
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or the error that ends the request (413 past the size limit, 408
        past the time limit); (None, None) when the client disconnected."""
        limits = self.state.http
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                message_ = f"The request body did not arrive within {limits.body_timeout_s:g} s"
                return None, APIError(408, message_, "body", headers=_CLOSE)
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > limits.max_body_bytes:
                return None, _too_large(limits.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds the limit of {limit} bytes", headers=_CLOSE)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first hands out the body already read, then the server's messages (a
    disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        message: Any = await receive()
        return message

    return replay


def _authorized(headers: dict[str, str], keys: tuple[str, ...]) -> bool:
    """Whether the bearer token is one of `keys`. Every key is compared, each in constant
    time, so the time taken tells nothing about which key (or how much of one) matched."""
    header = headers.get("authorization", "")
    token = (header[7:] if header.lower().startswith("bearer ") else "").encode()
    matches = [hmac.compare_digest(token, key.encode()) for key in keys]
    return any(matches)
