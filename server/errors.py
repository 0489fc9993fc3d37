"""Errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def context_length_error(limit: int, num_prompt: int, num_completion: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{num_prompt + num_completion} tokens ({num_prompt} in the messages, {num_completion} in "
        "the completion). Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
    )


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
        envelope(message, "invalid_request_error", param, kind or None), status_code=400
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
