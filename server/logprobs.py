"""Log-probabilities in OpenAI's two shapes (chat `logprobs.content`, completions'
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`).

The engine gives token ids and values (`engine.types.TokenLogprob`; `engine.logprobs` defines
the distribution); here they get their text. A chosen token's text is what it adds in context —
decoded with the few tokens before it — so a choice's tokens concatenate to its text (a token
that leaves a UTF-8 sequence unfinished adds "" and the one that finishes it adds the
character). A top alternative's text is the token decoded alone (memoised). A special token
whose decoded text is empty (the end of turn) is shown as the tokenizer spells it
("<end_of_turn>"), covering no characters of the choice's text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.types import TokenLogprob

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 8  # tokens of left context when decoding one token
MAX_PENDING = 256  # held-back tokens the context window reaches back over


@dataclass(frozen=True, slots=True)
class ShownLogprob:
    """One token's log-probability as it is shown: its text, value, alternatives, and where
    its text starts in the choice's text."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    offset: int


class TokenTexts:
    """Texts of a choice's tokens, for its log-probabilities."""

    def __init__(
        self, decode: Callable[[list[int]], str], special: Mapping[int, str] | None = None
    ) -> None:
        """`special`: each special token's id -> its spelling (the tokenizer's
        `special_token_texts`)."""
        self.decode = decode
        self.special: Mapping[int, str] = special or {}
        self._alone: dict[int, str] = {}
        self._pending = 0  # tokens just before, whose text is held back (trailing U+FFFD)
        self.offset = 0  # characters of the choice's text covered by the tokens shown so far

    def alone(self, token_id: int) -> str:
        text = self._alone.get(token_id)
        if text is None:
            text = self.decode([token_id]) or self.special.get(token_id, "")
            self._alone[token_id] = text
        return text

    def in_context(self, ids: list[int], i: int, final: bool) -> str:
        """What token i adds to the text. A trailing U+FFFD (an unfinished UTF-8 sequence, or
        bytes that never form one) is held back until a later token's text or the final one
        shows it, as the choice's text does; the window reaches back over held-back tokens."""
        lo = max(0, i - CONTEXT_TOKENS - self._pending)
        before = self.decode(ids[lo:i]).rstrip(REPLACEMENT)
        after = self.decode(ids[lo : i + 1])
        held = not final and after.endswith(REPLACEMENT)
        if held:
            after = after.rstrip(REPLACEMENT)
        self._pending = min(self._pending + 1, MAX_PENDING) if held else 0
        common = len(before) if after.startswith(before) else _common_prefix(before, after)
        return after[common:]

    def show(
        self, ids: list[int], start: int, entries: list[TokenLogprob], final: bool = False
    ) -> list[ShownLogprob]:
        """`entries` are the log-probabilities of ids[start : start + len(entries)]; `final`:
        the last of them ends the choice's text."""
        shown = []
        for k, entry in enumerate(entries):
            last = final and k == len(entries) - 1
            text = self.in_context(ids, start + k, last)
            top = tuple((self.alone(t), v) for t, v in entry.top)
            spelled = self.special.get(ids[start + k]) if not text else None
            shown.append(ShownLogprob(spelled or text, entry.logprob, top, self.offset))
            self.offset += len(text)
        return shown


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def chat_logprobs(shown: list[ShownLogprob]) -> dict[str, Any]:
    """OpenAI's chat `choices[].logprobs`."""

    def item(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = [
        {**item(s.token, s.logprob), "top_logprobs": [item(t, v) for t, v in s.top]} for s in shown
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(shown: list[ShownLogprob]) -> dict[str, Any]:
    """OpenAI's completions `choices[].logprobs`."""
    return {
        "tokens": [s.token for s in shown],
        "token_logprobs": [s.logprob for s in shown],
        "top_logprobs": [dict(s.top) for s in shown],
        "text_offset": [s.offset for s in shown],
    }
