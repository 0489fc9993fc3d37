"""OpenAI protocol: request models and their mapping onto engine parameters.

The models check types only (a wrong type is a 400 naming the field); every bound lives in
`SamplingParams` and `engine.validation`, shared with the offline API. OpenAI parameters Canvas
does not implement are rejected by name rather than ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from engine.params import KNOB_NAMES, ParamError, SamplingParams
from engine.validation import check_n, check_stop, check_user
from server.text import TextOptions

# OpenAI parameters Canvas does not implement, with their neutral values (accepted as no-ops;
# anything else is rejected with a 400 naming the parameter). The first is the default.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (False,),
    "suffix": (None,),
    "best_of": (1,),
    "min_tokens": (0,),
    "audio": (None,),
    "modalities": (None,),
    "prediction": (None,),
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


def is_neutral(value: Any, neutral: Any) -> bool:
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
    continuous_usage_stats: Bool = False  # vLLM's: with include_usage, usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must satisfy (a JSON text), or None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is None:
            raise ParamError(
                "response_format.json_schema", 'is required when type is "json_schema"'
            )
        return json.dumps(self.json_schema.schema_)


class CommonParams(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions; each decoding knob
    (`engine.params.DecodingKnobs`) is a field of the same name."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None  # (0, 1]; both modes (engine.logits)
    top_k: Int | None = None  # vLLM's extra: -1 or 0 = all tokens
    min_p: Float | None = None  # vLLM's extra; the logits processors' bounds: SamplingParams
    repetition_penalty: Float | None = None  # vLLM's extra
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None  # token id (a JSON key) -> bias
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras (extra_body): tokens that end the output as EOS does (left out of the
    # text, as EOS is, unless include_stop_str_in_output), special tokens kept in the text
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    # Canvas extras (extra_body)
    ignore_eos: Bool = False
    max_denoising_steps: Int | None = None
    entropy_bound: Float | None = None
    t_min: Float | None = None
    t_max: Float | None = None
    stability_threshold: Int | None = None
    confidence_threshold: Float | None = None
    # A registered decode mode (`engine.modes`; SamplingParams names the choices); None: the
    # checkpoint's default.
    mode: Annotated[str, Strict()] | None = None
    stream_drafts: Bool = False
    response_format: ResponseFormat | None = None
    # Unsupported OpenAI parameters are accepted by the schema and rejected by name in
    # `unsupported()` unless neutral, so the message can name the parameter.
    functions: Any = _neutral("functions")
    function_call: Any = _neutral("function_call")
    echo: Any = _neutral("echo")
    suffix: Any = _neutral("suffix")
    best_of: Any = _neutral("best_of")
    min_tokens: Any = _neutral("min_tokens")
    audio: Any = _neutral("audio")
    modalities: Any = _neutral("modalities")
    prediction: Any = _neutral("prediction")
    web_search_options: Any = _neutral("web_search_options")
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    def unsupported(self) -> str | None:
        """The first unsupported OpenAI parameter set to a non-neutral value, if any."""
        for name, neutrals in UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(is_neutral(value, neutral) for neutral in neutrals):
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
            mode=self.mode,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            json_schema=structured_schema(self),
            logprobs=self.logprob_count(),
            **{name: getattr(self, name) for name in KNOB_NAMES},
        )

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: the chosen token's and the top k alternatives'."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM: only with include_usage)."""
        options = self.stream_options
        return bool(self.include_usage and options and options.continuous_usage_stats)

    def text_options(self) -> TextOptions:
        return TextOptions(self.skip_special_tokens, self.include_stop_str_in_output)


MAX_PROMPTS = 64  # prompts in one /v1/completions request


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions
MAX_CHAT_LOGPROBS = 20


class CompletionRequest(CommonParams):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = None  # the number of top alternatives per token

    def logprob_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ParamError("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}]")
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (a string, a list of token ids, or a batch of either);
        ParamError for an empty prompt or batch, more than MAX_PROMPTS, or text that is not
        valid Unicode."""
        value = self.prompt
        if isinstance(value, list) and not value:
            raise ParamError("prompt", "must not be empty")
        single = isinstance(value, str) or isinstance(value[0], int)
        batch: list[str | list[int]] = [value] if single else list(value)  # type: ignore[list-item,arg-type]
        if len(batch) > MAX_PROMPTS:
            raise ParamError("prompt", f"at most {MAX_PROMPTS} prompts per request")
        for i, prompt in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt.{i}"
            if not prompt:
                raise ParamError(param, "must not be empty")
            if isinstance(prompt, str):
                check_text(param, prompt)
        return batch


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are accepted (checked in
    `server.chat`, so a rejection can say why)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Any = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # assistant: its thoughts, for templates that show them (vLLM's newer name, its older one)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # The openai SDK's `message.model_dump()` carries these, null when unused; `server.chat`
    # accepts them null (or empty) and refuses by name a value Canvas cannot honour.
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: Bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: {"enable_thinking": bool}
    logprobs: Bool | None = None
    top_logprobs: Int | None = None

    def logprob_count(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_CHAT_LOGPROBS:
            raise ParamError("top_logprobs", f"must be in [0, {MAX_CHAT_LOGPROBS}]")
        if not self.logprobs:
            if top:
                raise ParamError("top_logprobs", "needs logprobs: true")
            return None
        return top or 0

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`; None: the default."""
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ParamError("max_completion_tokens", "must be >= 1")
            return self.max_completion_tokens
        return self.max_tokens


def structured_schema(request: CommonParams) -> str | None:
    """The JSON schema the engine constrains this request's output to (a JSON text), or None.

    The one place a request's `SamplingParams.json_schema` is decided: a forced tool choice
    or `response_format` (not both)."""
    fmt = request.response_format.schema_text() if request.response_format else None
    forced = forced_tool_schema(request) if isinstance(request, ChatCompletionRequest) else None
    if fmt is not None and forced is not None:
        raise ParamError(
            "response_format", "cannot be combined with a forced tool_choice (both set the output)"
        )
    return fmt or forced


def schema_param(request: CommonParams) -> str:
    """The parameter a bad schema is blamed on."""
    if request.response_format is not None and request.response_format.type != "text":
        return "response_format"
    return "tools"


def arguments_schema(function: FunctionDef) -> dict[str, Any]:
    """The schema of a function's arguments: its `parameters`, an object either way."""
    return {"type": "object", **(function.parameters or {})}


def forced_tool_schema(request: ChatCompletionRequest) -> str | None:
    """For `tool_choice` naming a function: the function's arguments schema (the output is
    its arguments). For "required": an array of one or more {"name", "arguments"} objects, one
    alternative per tool (at most one item when `parallel_tool_calls` is false). Else None."""
    choice, tools = request.tool_choice, request.tools or []
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise ParamError(
                "tool_choice.function.name",
                f"names no function in tools (they are: {', '.join(names) or 'none'})",
            )
        tool = tools[names.index(choice.function.name)]
        return json.dumps(arguments_schema(tool.function))
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": arguments_schema(t.function),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return json.dumps(schema)
