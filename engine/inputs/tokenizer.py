"""Tokenizer access: the checkpoint's own tokenizer files, loaded offline with transformers.

Text from a client is plain text: a special token's spelling in it (`<eos>`, `<|turn>`, a tool
marker) is encoded as its characters, never as the control token, so only the chat template's
own markup (and the tokenizer's own BOS) yields control ids. Chat templates render in
transformers' sandboxed Jinja environment (`ImmutableSandboxedEnvironment`): a template that
reaches for Python internals fails with a SecurityError instead of running.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

_PROBE = [{"role": "user", "content": "Hello"}]  # renders once at load: is the template usable?


class Tokenizer:
    """Encode prompts, apply the chat template, decode ids. The engine itself only sees ids."""

    def __init__(self, model_dir: str | Path) -> None:
        """Raises ValueError naming `model_dir` when its chat template is not valid Jinja or
        breaks the sandbox's rules on a plain one-message conversation."""
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, **_config_for_tokenizer(Path(model_dir))
        )
        template = getattr(self._tok, "chat_template", None)
        self._template: str = template if isinstance(template, str) else ""
        # Template variables every conversation gets unless its request sets them
        # (`--default-chat-template-kwargs`).
        self.template_defaults: dict[str, Any] = {}
        self._markup_decoders: dict[frozenset[str], Callable[[list[int]], str]] = {}
        self._special_texts = {
            i: str(self._tok.convert_ids_to_tokens(i)) for i in self._special_ids()
        }
        # Added tokens (whitespace ones aside) a dict key must not spell: transformers'
        # sanitizer escapes the values of messages and tools, not their keys.
        spellings = [t.content for t in self._tok.added_tokens_decoder.values()]
        longest_first = sorted((s for s in spellings if s.strip()), key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        if self._template:
            self._check_template(f"the chat template of {model_dir}")

    def use_chat_template(self, template: str, where: str) -> None:
        """Render conversations with `template` (Jinja, in the same sandbox as the
        checkpoint's own) instead of the checkpoint's. Raises ValueError naming `where` (e.g.
        the flag that gave it) when it is not valid Jinja or breaks the sandbox's rules on a
        plain one-message conversation; the tokenizer is unchanged then."""
        old = self._tok.chat_template
        self._tok.chat_template = template
        try:
            self._check_template(where)
        except ValueError:
            self._tok.chat_template = old
            raise
        self._template = template

    def _check_template(self, where: str) -> None:
        """ValueError naming `where` when the template is not valid Jinja or breaks the
        sandbox on a plain one-message conversation."""
        from jinja2 import TemplateSyntaxError
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            self._tok.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        except TemplateSyntaxError as exc:
            raise ValueError(f"{where} is not valid Jinja (line {exc.lineno}): {exc}") from None
        except SecurityError as exc:
            raise ValueError(f"{where} breaks the template sandbox's rules: {exc}") from None
        except TemplateError:
            pass  # it may refuse a lone user message; a request's own conversation decides

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (for the grammar engine)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def special_token_texts(self) -> Mapping[int, str]:
        """Each special token's id -> its spelling (e.g. "<end_of_turn>"), which `decode`
        drops: how a log-probability shows such a token."""
        return self._special_texts

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders `tools` (a template that never reads the variable
        would drop them silently)."""
        return "tools" in self._template

    @property
    def template_knows_thinking(self) -> bool:
        """Whether the chat template has the `enable_thinking` switch."""
        return "enable_thinking" in self._template

    def encode(
        self, text: str, add_special_tokens: bool = True, *, markup: bool = False
    ) -> list[int]:
        """The ids of `text`, with the tokenizer's own special tokens (BOS) added unless told
        not to. `text` is plain text (a special token's spelling in it is its characters)
        unless `markup`: then the spellings are the tokens, as in a model's own output or
        training text; never for a client's text."""
        ids = self._tok.encode(
            text, add_special_tokens=add_special_tokens, split_special_tokens=not markup
        )
        return list(ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt ids of a conversation; `tools` and `template_kwargs` (e.g.
        enable_thinking; over `template_defaults`) are passed to the template. Every string in
        the messages and tools is plain text: only the template's own markup yields control
        ids. ValueError when there is no template, a dict key spells a special token, or the
        template refuses the conversation (its `raise_exception`, a missing field, a sandbox
        violation)."""
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        if not self._template:
            raise ValueError(
                "this checkpoint has no chat template; use the completions API instead"
            )
        self._check_keys([messages, tools, template_kwargs])
        tool_list: list[Any] | None = list(tools) if tools is not None else None
        try:
            ids = self._tok.apply_chat_template(
                messages,
                tools=tool_list,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                sanitize_control_tokens=True,  # the strings it is given are encoded as text
                **{**self.template_defaults, **(template_kwargs or {})},
            )
        except SecurityError as exc:
            raise ValueError(f"the chat template broke its sandbox's rules: {exc}") from None
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]  # type: ignore[call-overload,index]
        return list(ids)

    def _check_keys(self, value: Any) -> None:
        """ValueError when a dict key anywhere in `value` spells a special token (a template
        writes keys, e.g. of tool-call arguments, and nothing escapes them)."""
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and (found := self._control.search(key)):
                    raise ValueError(
                        f"the key {key!r} spells the special token {found.group()!r}; keys in "
                        "messages and tools cannot contain special tokens"
                    )
                self._check_keys(item)
        elif isinstance(value, list | tuple):
            for item in value:
                self._check_keys(item)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens are dropped, or spelled out when not
        `skip_special_tokens`."""
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def markup_decoder(self, keep: Collection[str]) -> Callable[[list[int]], str]:
        """A decode that keeps the special tokens spelled as in `keep` (a chat format's markup,
        e.g. Gemma 4's tool-call and thinking delimiters, which a parser must see) and drops
        every other special token, as `decode` does. Built once per `keep`."""
        key = frozenset(keep)
        if key not in self._markup_decoders:
            self._markup_decoders[key] = self._markup_decoder(key)
        return self._markup_decoders[key]

    def _special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids) | {
            i for i, t in self._tok.added_tokens_decoder.items() if t.special
        }

    def _markup_decoder(self, keep: frozenset[str]) -> Callable[[list[int]], str]:
        special = self._special_ids()
        keep_ids = {i for i in special if self._tok.convert_ids_to_tokens(i) in keep}
        drop = frozenset(special - keep_ids)

        def decode(ids: list[int]) -> str:
            kept = [i for i in ids if i not in drop]
            return str(self._tok.decode(kept, skip_special_tokens=False))

        return decode


def _config_for_tokenizer(model_dir: Path) -> dict[str, Any]:
    """AutoTokenizer reads config.json only to find the tokenizer class when
    tokenizer_config.json does not name one. A model_type transformers does not know (Canvas's
    own `canvas_llama`, from `canvas convert`) makes it fall back to a bare config and warn, on
    every start, that this "can yield errors" -- harmless here, since the tokenizer class comes
    from tokenizer_config.json either way. For such a checkpoint it is given an empty config
    instead (the same outcome, without the warning)."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}  # no config or an odd one: AutoTokenizer reports it as before
    return {} if model_type in CONFIG_MAPPING else {"config": PreTrainedConfig()}
