"""OpenAI protocol: request models and their mapping onto engine parameters.

The models check types only (a wrong type is a 400 naming the field); every bound lives in
`SamplingParams` and `engine.validation`, shared with the offline API. OpenAI parameters Canvas
does not implement are rejected by name rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from engine.params import DecodeMode, ParamError, SamplingParams
from engine.validation import check_n, check_stop, check_user

# OpenAI parameters Canvas does not implement, with their neutral values (accepted as no-ops;
# anything else is rejected with a 400 naming the parameter). The first is the default.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "suffix": (None,),
    "best_of": (1,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "top_p": (1.0,),
    "top_k": (-1,),
    "min_tokens": (0,),
    "parallel_tool_calls": (None,),
    "audio": (None,),
    "modalities": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}

# JSON numbers and booleans as they are: `max_tokens: true` is a 400, not 1.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an integer is a valid number
Bool = Annotated[bool, Strict()]


def _neutral(name: str) -> Any:
    """An unsupported parameter's field: its schema lists the only values accepted."""
    values = UNSUPPORTED[name]
    doc = "Not supported by Canvas: only these neutral values are accepted."
    return Field(values[0], json_schema_extra={"enum": list(values), "description": doc})


def _is_neutral(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) != isinstance(neutral, bool):  # True is not 1
        return False
    return bool(value == neutral)


def check_text(param: str, text: str) -> None:
    """ParamError when `text` is not valid Unicode (JSON lets a lone surrogate through)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ParamError(
            param,
            f"contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}; text must be valid Unicode",
        ) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False


class CommonParams(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Int | None = None
    temperature: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Canvas extras (extra_body)
    ignore_eos: Bool = False
    max_denoising_steps: Int | None = None
    entropy_bound: Float | None = None
    t_min: Float | None = None
    t_max: Float | None = None
    stability_threshold: Int | None = None
    confidence_threshold: Float | None = None
    mode: Literal["diffusion", "ar"] | None = None  # None: the checkpoint's default mode
    stream_drafts: Bool = False
    # Unsupported OpenAI parameters are accepted by the schema and rejected by name in
    # `unsupported()` unless neutral, so the message can name the parameter.
    tools: Any = _neutral("tools")
    tool_choice: Any = _neutral("tool_choice")
    functions: Any = _neutral("functions")
    function_call: Any = _neutral("function_call")
    response_format: Any = _neutral("response_format")
    logit_bias: Any = _neutral("logit_bias")
    logprobs: Any = _neutral("logprobs")
    top_logprobs: Any = _neutral("top_logprobs")
    echo: Any = _neutral("echo")
    suffix: Any = _neutral("suffix")
    best_of: Any = _neutral("best_of")
    presence_penalty: Any = _neutral("presence_penalty")
    frequency_penalty: Any = _neutral("frequency_penalty")
    repetition_penalty: Any = _neutral("repetition_penalty")
    top_p: Any = _neutral("top_p")
    top_k: Any = _neutral("top_k")
    min_tokens: Any = _neutral("min_tokens")
    parallel_tool_calls: Any = _neutral("parallel_tool_calls")
    audio: Any = _neutral("audio")
    modalities: Any = _neutral("modalities")
    prediction: Any = _neutral("prediction")
    reasoning_effort: Any = _neutral("reasoning_effort")
    web_search_options: Any = _neutral("web_search_options")
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    def unsupported(self) -> str | None:
        """The first unsupported OpenAI parameter set to a non-neutral value, if any."""
        for name, neutrals in UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(_is_neutral(value, neutral) for neutral in neutrals):
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
    prompt: str | list[str] | list[Int] | list[list[Int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; ParamError for an empty or batched prompt, or text
        that is not valid Unicode."""
        prompt = self._single_prompt()
        if isinstance(prompt, str):
            check_text("prompt", prompt)
        return prompt

    def _single_prompt(self) -> str | list[int]:
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
    max_completion_tokens: Int | None = None

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`; None: the default."""
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ParamError("max_completion_tokens", "must be >= 1")
            return self.max_completion_tokens
        return self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The conversation for the chat template; ParamError when there is none or a message
        is not valid Unicode."""
        if not self.messages:
            raise ParamError("messages", "must contain at least one message")
        role = {"developer": "system"}
        chat = [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]
        for i, message in enumerate(chat):
            check_text(f"messages.{i}.content", message["content"])
        return chat
