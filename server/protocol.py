"""OpenAI protocol: request models, validation, and the mapping onto engine parameters.

Validation happens here, once: every bad field becomes a 400 that names it. OpenAI parameters
Canvas does not implement are rejected by name rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8
MAX_STOP = 4
MAX_STOP_LEN = 256

# OpenAI parameters Canvas does not implement: rejected (400 naming the parameter) when set to
# anything but their neutral value.
UNSUPPORTED: dict[str, Any] = {
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "logit_bias": None,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_tokens": 0,
    "parallel_tool_calls": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "reasoning_effort": None,
    "web_search_options": None,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CommonParams(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # Canvas extras (extra_body)
    ignore_eos: bool = False
    max_denoising_steps: int | None = Field(default=None, ge=1, le=1024)
    entropy_bound: float | None = Field(default=None, gt=0.0)
    t_min: float | None = Field(default=None, ge=0.0)
    t_max: float | None = Field(default=None, gt=0.0)
    stability_threshold: int | None = Field(default=None, ge=0, le=64)
    confidence_threshold: float | None = Field(default=None, ge=0.0)
    mode: Literal["diffusion", "ar"] | None = None  # None: the checkpoint's default mode
    stream_drafts: bool = False
    # Unsupported OpenAI parameters are accepted by the schema and rejected by name in
    # `unsupported()`, so the message can say what the neutral value would be.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = False
    suffix: Any = None
    best_of: Any = 1
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    top_p: Any = 1.0
    top_k: Any = -1
    min_tokens: Any = 0
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_LEN} characters")
        return stops

    def unsupported(self) -> str | None:
        """The first unsupported OpenAI parameter set to a non-neutral value, if any."""
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is None or value == neutral:
                continue
            if name == "logprobs" and value is False:
                continue
            return name
        return None

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(CommonParams):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], int):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        return value

    def single_prompt(self) -> str | list[int]:
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return value[0]  # type: ignore[return-value]
        return value  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]
