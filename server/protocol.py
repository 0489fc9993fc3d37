"""OpenAI protocol: request models and their mapping onto engine parameters.

The models check types only (a wrong type is a 400 naming the field); every bound lives in
`SamplingParams` and `engine.validation`, shared with the offline API. OpenAI parameters Canvas
does not implement are rejected by name rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.params import DecodeMode, ParamError, SamplingParams
from engine.validation import check_n, check_stop, check_user

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
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Canvas extras (extra_body)
    ignore_eos: bool = False
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
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
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine parameters of this request (`max_tokens` None: the checkpoint's default),
        after the bounds of the HTTP-only fields; raises ParamError naming the parameter."""
        check_n(self.n)
        check_stop(self.stop_strings)
        check_user(self.user)
        return SamplingParams(
            max_tokens=max_tokens,
            mode=DecodeMode(self.mode) if self.mode else None,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            max_denoising_steps=self.max_denoising_steps,
            entropy_bound=self.entropy_bound,
            t_min=self.t_min,
            t_max=self.t_max,
            stability_threshold=self.stability_threshold,
            confidence_threshold=self.confidence_threshold,
            temperature=self.temperature,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(CommonParams):
    prompt: str | list[str] | list[int] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; ParamError for an empty or batched prompt."""
        value = self.prompt
        if isinstance(value, list) and not value:
            raise ParamError("prompt", "must not be empty")
        if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], int):
            raise ParamError("prompt", "batched prompts are not supported; send one per request")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            return value[0]
        return value


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
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`; None: the default."""
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ParamError("max_completion_tokens", "must be >= 1")
            return self.max_completion_tokens
        return self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The conversation for the chat template; ParamError when there is none."""
        if not self.messages:
            raise ParamError("messages", "must contain at least one message")
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]
