"""What the server holds for its lifetime: the engine client, the tokenizer, the validator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.params import DecodingDefaults
from engine.types import EngineClient
from engine.validation import RequestValidator
from server.metrics import Metrics

if TYPE_CHECKING:  # the tokenizer module loads transformers; the server only calls it
    from engine.tokenizer import Tokenizer

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    tokenizer: Tokenizer | None
    defaults: DecodingDefaults
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ready: bool = False
    draining: bool = False
    metrics: Metrics = field(init=False)
    validator: RequestValidator = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name)
        self.validator = RequestValidator(self.defaults, self.engine.limits)
