"""Errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}.

`to_api_error` is the one mapping from what the validator and the engine raise to an HTTP
status: ParamError → 400 (ContextLengthError → 400 `context_length_exceeded`), QueueFull → 429
with Retry-After, anything else → 500 naming the request id. Client mistakes are never 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


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


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _param_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) if parts else "body"


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    param = _param_of(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = "The request body is not valid JSON."
        param = "body"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"Missing required parameter: {param}"
    else:
        message = f"Invalid value for {param}: {first.get('msg', 'invalid')}"
    return JSONResponse(
        envelope(message, "invalid_request_error", str(param), str(kind) if kind else None),
        status_code=400,
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
