"""Tokenizer access: the checkpoint's own tokenizer files, loaded offline with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    """Encode prompts, apply the chat template, decode ids. The engine itself only sees ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (for the grammar engine)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(
                "this checkpoint has no chat template; use the completions API instead"
            )
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]  # type: ignore[call-overload,index]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))
