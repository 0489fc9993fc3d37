"""Structured outputs: a JSON schema per request, enforced on every token it commits, in both
decoding modes, for any model (even random weights).

Grammar engine: llguidance (PyPI `llguidance`, Microsoft's Rust engine behind Guidance and used
by vLLM and SGLang). Chosen over xgrammar and outlines-core: it has no Python dependencies
(xgrammar pulls an unpinned torch, triton and a TVM runtime), compiles a schema lazily (no
up-front automaton over the whole vocabulary, so a new schema costs milliseconds, not seconds),
and answers the two questions a canvas needs cheaply: "how many of these tokens are valid from
here" (`validate_tokens`) and "which tokens may come next" (a mask). Its cost is measured in
docs/performance.md.

How a request is constrained (`Constraint`):
- AR rows: before sampling, the next-token logits outside the grammar's mask are set to -inf;
  the sampled token is then consumed by the matcher (or replaced, see Termination).
- Diffusion canvases denoise freely; when a canvas converges, its draft is *repaired* left to
  right before it is committed: the longest grammar-valid prefix of the draft is kept (one
  `validate_tokens` call), at the first invalid position the best allowed token under the final
  step's logits at that position replaces the draft's, and so on to the end of the canvas. A
  committed canvas is therefore always a valid continuation of the grammar state.
- Termination: a document must be closed within the token budget. A copy of the matcher is run
  ahead with the closing policy (`_closing_choice`: an end token, `}`, `]`, `,`, `0`, `"`;
  inside a string its closing quote; else the smallest allowed token) to estimate how many
  tokens closing takes; once the remaining budget comes near that estimate, a token is
  committed only if closing still fits after it, else the closing policy's token is, so the
  document ends in the budget whenever it can. When it cannot (a budget smaller than the
  shortest document), the request ends with finish_reason "length", never with an unfinished
  document claimed complete.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.params import ParamError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Closing tokens, most preferred first, after an end-of-sequence token: inside a JSON string
# its closing quote; outside, what ends a container or completes a value in one token.
STRING_CLOSERS = ('"',)
CLOSERS = ("}", "]", ",", "0", '"')
# Re-estimate the closing length every this many positions while the budget is comfortable,
# and at every position once it is within this many tokens of the last estimate.
PROBE_EVERY = 8
PROBE_SLACK = 24
MAX_CLOSING = 128  # a closing estimate stops here (the budget is then "not enough")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact separators: no unbounded whitespace


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer; thread-safe, compiled grammars cached by schema
    text (LRU). `constraint()` builds a request's matcher: call it off the step loop."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], cache: int = 256
    ) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._closers = (
            _token_ids(hf_tokenizer, vocab_size, CLOSERS),
            _token_ids(hf_tokenizer, vocab_size, STRING_CLOSERS),
        )
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache
        self._lock = threading.Lock()

    def grammar(self, schema: str, param: str = "response_format") -> str:
        """The compiled grammar of a JSON schema (a string); ParamError naming `param` when the
        schema is not valid JSON or not a schema llguidance supports."""
        with self._lock:
            if schema in self._cache:
                self._cache.move_to_end(schema)
                return self._cache[schema]
        from llguidance import LLMatcher

        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ParamError(param, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ParamError(param, "the JSON schema must be a JSON object")
        try:
            grammar = LLMatcher.grammar_from_json_schema(parsed, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ParamError(param, f"invalid JSON schema: {exc}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ParamError(param, f"unsupported JSON schema: {'; '.join(messages)}")
        with self._lock:
            self._cache[schema] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, schema: str, param: str = "response_format") -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.grammar(schema, param), log_level=0)
        if matcher.is_error():
            raise ParamError(param, f"unsupported JSON schema: {matcher.get_error()}")
        return Constraint(
            matcher, self.tokenizer, self.vocab_size, self.eos_token_ids, self._closers
        )


def grammar_compiler(
    tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompiler | None:
    """A compiler for an `engine.inputs.tokenizer.Tokenizer`, or None (with a warning) when
    llguidance cannot take this tokenizer (it needs a fast tokenizer)."""
    try:
        return GrammarCompiler(tokenizer.hf, vocab_size, eos_token_ids)
    except (ValueError, RuntimeError, TypeError) as exc:
        logger.warning("structured outputs are off: llguidance cannot use this tokenizer: %s", exc)
        return None


def _token_ids(hf_tokenizer: Any, vocab_size: int, texts: tuple[str, ...]) -> list[int]:
    """Token ids whose text is exactly one of `texts`, in that order."""
    ids = []
    for text in texts:
        encoded = hf_tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] < vocab_size:
            ids.append(int(encoded[0]))
    return ids


class Constraint:
    """One request's grammar state: what it has committed so far is a valid prefix."""

    def __init__(
        self,
        matcher: Any,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        closers: tuple[list[int], list[int]],
    ) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer  # llguidance's, for the bytes of a token
        self.vocab_size = vocab_size
        self.eos = eos_token_ids
        self.closers, self.string_closers = closers
        self.lex = JsonLex()  # where the committed text stands (in a string or not)
        self._estimate: int | None = None  # tokens the closing policy needs from here
        self._since_probe = 0

    def fork(self) -> Constraint:
        """An independent copy (the matcher deep-copied): a step advances a fork, and the
        request takes it only if the step succeeds."""
        twin = Constraint.__new__(Constraint)
        twin.matcher = self.matcher.deep_copy()
        twin.tokenizer, twin.vocab_size, twin.eos = self.tokenizer, self.vocab_size, self.eos
        twin.closers, twin.string_closers = self.closers, self.string_closers
        twin.lex = self.lex.copy()
        twin._estimate, twin._since_probe = self._estimate, self._since_probe
        return twin

    # -- the mask and the closing policy --

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab_size] (CPU)."""
        return _allowed_of(self.matcher, self.vocab_size)

    def _closing_choice(self, lex: JsonLex, allowed: torch.Tensor) -> int:
        closers = self.string_closers if lex.in_string else self.closers
        for token in (*sorted(self.eos), *closers):
            if token < self.vocab_size and allowed[token]:
                return token
        return int(allowed.nonzero()[0, 0]) if bool(allowed.any()) else -1

    def _closing_length(self, then: int | None = None) -> int:
        """Tokens the closing policy takes from the current state (after `then`, when given)
        to the end, the end token included; MAX_CLOSING when it does not get there."""
        probe, lex = self.matcher.deep_copy(), self.lex.copy()
        ended = False  # the last token was an end token
        for count in range(MAX_CLOSING):
            if then is not None:
                token, then = then, None
            elif probe.is_stopped():  # the grammar is complete; an end token may still be due
                return count if ended else count + 1
            else:
                token = self._closing_choice(lex, _allowed_of(probe, self.vocab_size))
            if token < 0 or not probe.consume_token(token):
                return MAX_CLOSING
            ended = token in self.eos
            lex.feed(self.tokenizer.decode_bytes([token]))
        return MAX_CLOSING

    def _near_end(self, remaining: int) -> bool:
        """Whether the budget is within reach of the closing estimate (re-estimated every
        PROBE_EVERY tokens, and at every token once near)."""
        self._since_probe += 1
        due = self._estimate is None or self._since_probe >= PROBE_EVERY
        if due or remaining <= self._estimate + PROBE_SLACK:  # type: ignore[operator]
            self._estimate = self._closing_length()
            self._since_probe = 0
        return remaining <= self._estimate + PROBE_SLACK  # type: ignore[operator]

    def choose(self, candidate: int | None, remaining: int) -> int:
        """The token to commit next, `remaining` tokens (this one included) being left:
        `candidate` (grammar-valid, or None) if the document can still be closed after it
        within the budget, else the closing policy's token (-1: nothing is allowed)."""
        if candidate is not None and not self._near_end(remaining):
            return candidate
        if candidate is not None and remaining - 1 >= self._closing_length(then=candidate) - (
            1 if candidate in self.eos else 0
        ):
            return candidate
        return self._closing_choice(self.lex, self.allowed())

    # -- AR --

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Before sampling an AR token: logits [V] (any device) outside the grammar set to
        -inf in place (the mask moves from pinned memory on a GPU: `to_device`)."""
        from engine.device.cuda import to_device

        allowed = to_device(self.allowed().numpy(), logits.device)
        logits.masked_fill_(~allowed, float("-inf"))

    def commit_ar(self, sampled: int, remaining: int) -> int:
        """After sampling: the token to commit (the sampled one, or the closing policy's when
        the budget says so), consumed; -1 when the grammar refuses (a bug)."""
        if self.matcher.is_stopped():  # the document is complete: only an end token is left
            return min(self.eos)
        if not self.matcher.validate_tokens([sampled]):  # the mask was not applied: a bug
            return -1
        token = self.choose(sampled, remaining)
        return token if token >= 0 and self.consume([token]) else -1

    def consume(self, tokens: list[int]) -> bool:
        """Advance over committed tokens; False if the grammar refused one."""
        self.lex.feed(self.tokenizer.decode_bytes(tokens))
        return bool(self.matcher.consume_tokens(tokens))

    # -- diffusion --

    def repair(self, draft: list[int], logits: torch.Tensor, budget: int) -> list[int]:
        """A converged canvas made grammar-valid before it is committed (see the module
        docstring). logits: [L, V] the final step's raw logits. Returns the canvas to commit;
        positions past an end token or past `budget` are left as drafted (they are cut)."""
        out = list(draft)
        end = min(len(draft), budget)
        i = 0
        while i < end and not self.matcher.is_stopped():
            candidate: int | None = out[i]
            if not self.matcher.validate_tokens(out[i : i + 1]):
                allowed = self.allowed()
                row = logits[i].float().masked_fill(~allowed.to(logits.device), float("-inf"))
                candidate = int(row.argmax()) if bool(allowed.any()) else None
            token = self.choose(candidate, budget - i)
            if token < 0 or not self.consume([token]):
                break  # nothing allowed: leave the rest; the request ends by its budget
            out[i] = token
            i += 1
        if i < end and self.matcher.is_stopped() and self.eos:
            out[i] = min(self.eos)  # the document is complete (maybe in an earlier canvas): end
        return out


def _allowed_of(matcher: Any, vocab_size: int) -> torch.Tensor:
    import torch

    bias = matcher.compute_logit_bias()
    mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[:vocab_size] != 0
    if mask.numel() < vocab_size:
        mask = torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])
    return mask


class JsonLex:
    """Whether JSON text fed so far ends inside a string (the closing policy's one question)."""

    __slots__ = ("escaped", "in_string")

    def __init__(self, in_string: bool = False, escaped: bool = False) -> None:
        self.in_string, self.escaped = in_string, escaped

    def copy(self) -> JsonLex:
        return JsonLex(self.in_string, self.escaped)

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.escaped:
                self.escaped = False
            elif self.in_string and byte == 0x5C:  # backslash
                self.escaped = True
            elif byte == 0x22:  # quote
                self.in_string = not self.in_string
