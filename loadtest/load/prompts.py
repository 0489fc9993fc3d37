"""Deterministic prompt sets for load tests: generated from a seed, nothing downloaded.

Lengths are in words, so a set means the same thing for any tokenizer (a byte-level tokenizer
makes about six tokens of a word, a real one about one and a third).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# A small fixed vocabulary keeps prompts readable and the same on every machine.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it this be are or an which has "
    "model canvas token step block server request cache page batch stream queue latency time "
    "river mountain city garden window kitchen library market station harbor forest desert "
    "bright quiet early rapid gentle narrow ancient modern simple careful heavy silver "
    "explain describe compare summarise list write translate measure build answer choose "
    "why how what where when who because although while after before during between"
)
WORDS = tuple(_WORD_TEXT.split())
TOPICS = (
    "the water cycle",
    "how a bicycle gear works",
    "the history of paper",
    "why the sky is blue",
    "how caches speed up programs",
    "the rules of chess",
    "how bread rises",
    "the phases of the moon",
)
SYSTEM_PROMPT = "You are a concise, helpful assistant."


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: chat messages, and the same content as one completion string."""

    name: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    num_words: int

    @property
    def text(self) -> str:
        """The prompt for /v1/completions: the message contents joined by blank lines."""
        return "\n\n".join(content for _, content in self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _question(rng: random.Random, index: int, num_words: int) -> Prompt:
    topic = TOPICS[index % len(TOPICS)]
    lead = f"Question {index}: explain {topic}."
    filler = max(0, num_words - len(lead.split()))
    content = f"{lead} {_words(rng, filler)}".strip()
    messages = (("system", SYSTEM_PROMPT), ("user", content))
    return Prompt(f"q{index}", messages, len(content.split()))


def short_chat(num: int, seed: int = 0) -> list[Prompt]:
    """Chat questions of 8 to 24 words, like an assistant's typical turn."""
    rng = random.Random(seed)
    return [_question(rng, i, rng.randint(8, 24)) for i in range(num)]


def long_prompt(num: int, seed: int = 0, num_words: int = 600) -> list[Prompt]:
    """A long document (about `num_words` words) followed by a question about it."""
    rng = random.Random(seed)
    return [_question(rng, i, num_words) for i in range(num)]


def mixed(num: int, seed: int = 0, max_words: int = 600) -> list[Prompt]:
    """Lengths spread log-uniformly from 8 to `max_words` words (short turns dominate)."""
    rng = random.Random(seed)
    lengths = [round(8 * (max_words / 8) ** rng.random()) for _ in range(num)]
    return [_question(rng, i, n) for i, n in enumerate(lengths)]


PROMPT_SETS: dict[str, Callable[[int, int], list[Prompt]]] = {
    "short-chat": short_chat,
    "long-prompt": long_prompt,
    "mixed": mixed,
}


def make_prompts(name: str, num: int, seed: int = 0) -> list[Prompt]:
    """`num` prompts of the set `name` (see PROMPT_SETS); the same for the same arguments."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {sorted(PROMPT_SETS)}")
    if num < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {num}")
    return PROMPT_SETS[name](num, seed)
