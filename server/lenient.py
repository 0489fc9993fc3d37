"""`--ignore-unknown-params`: a request body's unknown fields (anywhere in it), the OpenAI
parameters Canvas does not honour (`server.protocol.UNSUPPORTED`, set to a value other than
their neutral ones) and the SDK's message fields it cannot render (`server.chat.SDK_FIELDS`,
not null) are dropped before the route reads the body (on /v1/responses: unknown top-level
fields; `previous_response_id` and the others it refuses stay refused), and logged once per field
name, for platforms that must pass their clients' traffic through. Without the flag each is a
400 naming it (the request models forbid extra fields).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ValidationError

from server.chat import SDK_FIELDS
from server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest, is_neutral
from server.responses import PASSTHROUGH, ResponsesRequest

logger = logging.getLogger(__name__)

# The request models of the routes whose bodies are made lenient, by path.
BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
}


class UnknownParams:
    """Drops what a body's model would refuse as unknown or unsupported; remembers which
    field names it has logged, so each is logged once."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def strip(self, path: str, body: bytes) -> bytes:
        """`body` without the fields the model at `path` does not know or Canvas does not
        honour; `body` itself when nothing is dropped (or it is not a JSON object, or `path`
        has no model): the route reports what is wrong with it."""
        model = BODY_MODELS.get(path.rstrip("/"))
        if model is None:
            return body
        try:
            value = json.loads(body)
        except ValueError:
            return body
        if not isinstance(value, dict):
            return body
        dropped: list[tuple[str | int, ...]]
        if model is ResponsesRequest:  # its fields Canvas cannot honour stay refused
            dropped = [(k,) for k in value if k not in model.model_fields and k not in PASSTHROUGH]
        else:
            dropped = [*_unknown(model, value), *_unsupported(value)]
        for loc in dropped:
            _drop(value, loc)
            self._log(loc)
        return json.dumps(value).encode() if dropped else body

    def _log(self, loc: tuple[str | int, ...]) -> None:
        name = ".".join(str(part) for part in loc if not isinstance(part, int))
        if name not in self.logged:
            self.logged.add(name)
            where = ".".join(map(str, loc))
            logger.warning(
                "ignoring the request field '%s' (unknown or not supported; "
                "--ignore-unknown-params); it is logged once",
                where,
            )


def _unknown(model: type[BaseModel], value: dict[str, Any]) -> list[tuple[str | int, ...]]:
    """The locations of the fields `model` forbids as extra."""
    try:
        model.model_validate(value)
    except ValidationError as exc:
        return [tuple(e["loc"]) for e in exc.errors() if e["type"] == "extra_forbidden"]
    return []


def _unsupported(value: dict[str, Any]) -> list[tuple[str | int, ...]]:
    """The unsupported OpenAI parameters set to a value that is not neutral, and the SDK's
    message fields set to a value."""
    found: list[tuple[str | int, ...]] = []
    for name, neutrals in UNSUPPORTED.items():
        if name in value and not any(is_neutral(value[name], n) for n in neutrals):
            found.append((name,))
    messages = value.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            found += [("messages", i, k) for k in SDK_FIELDS if message.get(k) not in (None, [])]
    return found


def _drop(value: Any, loc: tuple[str | int, ...]) -> None:
    """Delete the field at `loc` (keys and list indices, outermost first) if it is there."""
    *path, last = loc
    for part in path:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(value, dict):
        value.pop(last, None)
