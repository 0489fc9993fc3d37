"""Errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}.

`to_api_error` is the one mapping from what the validator and the engine raise to an HTTP
status: ParamError → 400 (ContextLengthError → 400 `context_length_exceeded`), QueueFull → 429
with Retry-After, anything else → 500 naming the request id. Client mistakes are never 5xx.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.params import ParamError
from engine.types import QueueFull
from engine.validation import ContextLengthError

QUEUE_FULL_RETRY_AFTER = "1"  # seconds
DRAINING_RETRY_AFTER = "5"

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


class ClientGone(Exception):
    """The client disconnected before its response; its engine requests are aborted."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return envelope(
            self.message, TYPES.get(self.status, "invalid_request_error"), self.param, self.code
        )


def envelope(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def context_length_error(exc: ContextLengthError) -> APIError:
    num_prompt, num_completion = exc.num_prompt, exc.num_completion
    return APIError(
        400,
        f"This model's maximum context length is {exc.limit} tokens. However, you requested "
        f"{num_prompt + num_completion} tokens ({num_prompt} in the messages, {num_completion} in "
        "the completion). Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
    )


def queue_full_error() -> APIError:
    return APIError(
        429,
        "Too many requests are waiting; retry later",
        code="queue_full",
        headers={"Retry-After": QUEUE_FULL_RETRY_AFTER},
    )


def draining_error() -> APIError:
    return APIError(503, "The server is draining", headers={"Retry-After": DRAINING_RETRY_AFTER})


def to_api_error(exc: BaseException, request_id: str, prompt_param: str = "prompt") -> APIError:
    """The HTTP error for an exception raised while serving request `request_id`. A ParamError
    about the prompt names `prompt_param` (chat requests: "messages")."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return queue_full_error()
    if isinstance(exc, ContextLengthError):
        return context_length_error(exc)
    if isinstance(exc, ParamError):
        param = prompt_param if exc.param == "prompt" else exc.param
        return APIError(400, str(exc), param)
    return APIError(500, f"Engine error for request {request_id}: {exc}")


async def client_gone_handler(_: Request, exc: Exception) -> Response:
    """Nobody reads this response; 499 (nginx's "client closed request") marks it in the log."""
    return Response(status_code=499)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# A pydantic union reports one error per member, its loc tagged with the member's type
# ('str', 'list[int]', 'TextPart'); field names are lower-case words or indices.
_UNION_TAG = re.compile(r"[a-z-]+\[.*\]|str|int|float|bool|none|[A-Z]\w*")
UNION_FIELDS = {  # what a union-typed field accepts, as a 400 says it
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of content parts ({"type": "text", "text": ...})',
}
_SPECIFIC = ("literal_error", "extra_forbidden", "missing")  # say more than "wrong type"
NOT_AN_OBJECT = "model_attributes_type"  # pydantic's name for "the body is not an object"


def _loc(error: Any) -> tuple[list[str], bool]:
    """The field path of a validation error without 'body' and union tags, and whether it
    went through a union."""
    parts, union = [], False
    for p in error.get("loc", ()):
        if p == "body":
            continue
        if isinstance(p, str) and _UNION_TAG.fullmatch(p):
            union = True
            continue
        parts.append(str(p))
    return parts, union


def validation_message(errors: list[Any]) -> tuple[str, str, str | None]:
    """(message, param, code) of a request body's validation errors: the most specific one,
    or for a union-typed field that matches none of its types, what that field accepts."""
    if not errors:
        return "Invalid request", "body", None
    located = [(_loc(e), e) for e in errors]
    specific = [x for x in located if x[1].get("type") in _SPECIFIC]
    (parts, union), first = max(specific or located[:1], key=lambda x: len(x[0][0]))
    param = ".".join(parts) or "body"
    kind = str(first.get("type", "")) or None
    if kind == "json_invalid":
        return "The request body is not valid JSON.", "body", kind
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param, kind
    if kind == "missing":
        return f"Missing required parameter: {param}", param, kind
    if union and not specific:
        field = next((p for p in reversed(parts) if p in UNION_FIELDS), None)
        if field is not None:
            path = ".".join(parts[: len(parts) - parts[::-1].index(field)])
            return f"Invalid value for {path}: must be {UNION_FIELDS[field]}", path, kind
    return f"Invalid value for {param}: {first.get('msg', 'invalid')}", param, kind


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(e.get("type") == NOT_AN_OBJECT and tuple(e.get("loc", ())) == ("body",) for e in errors):
        return body_not_an_object(request.headers.get("content-type"))
    message, param, code = validation_message(errors)
    return JSONResponse(envelope(message, "invalid_request_error", param, code), status_code=400)


def body_not_an_object(content_type: str | None) -> JSONResponse:
    """The body was not read as a JSON object: 415 when it was not sent as JSON (FastAPI reads
    a body as JSON only with a JSON content type; `curl -d` sends a form type), else 400."""
    if content_type is None or not is_json_type(content_type):
        sent = f"was {content_type!r}" if content_type else "is missing"
        message = (
            f"Send the request body as JSON with the header 'Content-Type: application/json' "
            f"(this request's Content-Type {sent})."
        )
        return JSONResponse(
            envelope(message, "invalid_request_error", "Content-Type", "unsupported_media_type"),
            status_code=415,
        )
    message = 'The request body must be a JSON object, e.g. {"model": ..., "messages": [...]}.'
    return JSONResponse(envelope(message, "invalid_request_error", "body", NOT_AN_OBJECT), 400)


def is_json_type(content_type: str) -> bool:
    """application/json or application/*+json, with or without parameters (as FastAPI reads)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = str(exc.detail) if exc.detail else "error"
    if status == 404:
        message = "Not found: no such route"
    return JSONResponse(
        envelope(message, TYPES.get(status, "invalid_request_error")),
        status_code=status,
        headers=getattr(exc, "headers", None),
    )
