"""Incremental detokenization with stop strings, for one choice of one request.

Committed tokens never change, so text only ever grows; a trailing incomplete UTF-8 sequence is
held back until the next tokens complete it, and so is a tail that may be the start of a stop
string (sent text is never taken back). Stop strings cut the text before their first
occurrence (after it, with `include_stop`), even inside a canvas or across two, and end the
choice.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# Each add decodes only the tokens after the settled text, plus CONTEXT tokens before them so
# that the boundary decodes as it does inside the whole text (a SentencePiece word's leading
# space, a byte sequence, a clean-up rule); the text settles every SETTLE tokens. A stream of n
# tokens costs O(n) decoding instead of O(n^2).
CONTEXT = 6
SETTLE = 32


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How a choice's tokens become text, as vLLM's request fields of these names say:
    special tokens dropped (or spelled out), and whether the text keeps what ended it (a stop
    string, or the text of the stop token or EOS that ended the choice)."""

    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


PLAIN_TEXT = TextOptions()  # the defaults: special tokens and what ended the text left out


def without(
    decode: Callable[[list[int]], str], hidden: Collection[int]
) -> Callable[[list[int]], str]:
    """`decode` of the ids less those in `hidden` (the tokens that end a request, which the
    engine commits but the text leaves out); `decode` itself when there are none."""
    if not hidden:
        return decode
    return lambda ids: decode([i for i in ids if i not in hidden])


class TextStream:
    def __init__(
        self, decode: Callable[[list[int]], str], stop: list[str], include_stop: bool = False
    ) -> None:
        self.decode = decode
        self.stop = stop
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""  # all text so far (stable part)
        self.emitted = 0  # characters already handed out
        self.stopped = False
        self.num_tokens_at_stop: int | None = None
        self._settled = 0  # tokens whose text is settled
        self._settled_text = ""  # decode(token_ids[:_settled])
        self._head = ""  # decode() of the CONTEXT tokens before _settled

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append committed tokens; return the new text to send (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids += token_ids
        text = self._decode_all()
        if not final:
            text = text.rstrip(REPLACEMENT)
        found = self._first_stop(text)
        if found is not None:
            cut = found[0] + found[1] if self.include_stop else found[0]
            text = text[:cut]
            self.stopped = True
            self.num_tokens_at_stop = self.tokens_covering(cut)
        self.text = text
        end = len(text) if final or self.stopped else len(text) - self._partial_stop(text)
        delta = text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _decode_all(self) -> str:
        """decode(token_ids), decoding again only what follows the settled text."""
        ids, settled = self.token_ids, self._settled
        text = None
        if settled:
            window = self.decode(ids[max(0, settled - CONTEXT) :])
            if window.startswith(self._head):
                text = self._settled_text + window[len(self._head) :]
        if text is None:
            text = self.decode(ids)  # the first tokens, or a boundary that decodes differently
        if len(ids) - settled >= SETTLE and not text.endswith(REPLACEMENT):
            self._settled, self._settled_text = len(ids), text
            self._head = self.decode(ids[max(0, len(ids) - CONTEXT) :])
        return text

    @property
    def num_tokens(self) -> int:
        return (
            self.num_tokens_at_stop if self.num_tokens_at_stop is not None else len(self.token_ids)
        )

    def _first_stop(self, text: str) -> tuple[int, int] | None:
        """(where, length) of the first stop string in `text` (the longest of those starting
        there), or None."""
        if not self.stop:
            return None
        start = max(0, self.emitted - max(len(s) for s in self.stop))
        hits = [(text.find(s, start), -len(s)) for s in self.stop]
        found = min(((i, size) for i, size in hits if i >= 0), default=None)
        return None if found is None else (found[0], -found[1])

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def tokens_covering(self, num_chars: int) -> int:
        """The fewest tokens whose text reaches `num_chars` characters (usage accounting)."""
        lo, hi = 0, len(self.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(self.token_ids[:mid])) >= num_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo
