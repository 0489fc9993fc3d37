"""Varied chat prompts for self-distillation, generated (never downloaded): short factual
questions, explanations, lists and small writing tasks, built from templates and topics. The
shipped evaluation questions (`data/eval_prompts.jsonl`) are never among them."""

from __future__ import annotations

import json
import random
from pathlib import Path

EVAL_PROMPTS = Path(__file__).parent / "data" / "eval_prompts.jsonl"

COUNTRIES = (
    "Canada", "Mexico", "Egypt", "Kenya", "India", "China", "Australia", "Argentina", "Chile",
    "Peru", "Norway", "Sweden", "Finland", "Poland", "Greece", "Turkey", "Portugal", "Ireland",
    "Austria", "Belgium", "Switzerland", "Thailand", "Vietnam", "Indonesia", "Nigeria",
    "Morocco", "South Korea", "New Zealand", "Cuba", "Denmark", "Hungary", "Colombia",
)  # fmt: skip
THINGS = (
    "a volcano", "a rainbow", "gravity", "a black hole", "the moon", "a glacier", "DNA",
    "electricity", "a computer", "the internet", "an atom", "a vaccine", "a hurricane",
    "an earthquake", "a desert", "a rainforest", "a comet", "the heart", "the brain", "a battery",
    "a magnet", "sound", "light", "friction", "evaporation", "a bicycle", "a telescope",
    "a calendar", "democracy", "inflation", "a library", "a bridge", "a river", "honey",
)  # fmt: skip
CATEGORIES = (
    "fruits", "vegetables", "animals that live in the ocean", "birds", "musical instruments",
    "sports played with a ball", "colors", "planets", "programming languages", "board games",
    "kitchen tools", "flowers", "famous scientists", "countries in Africa", "trees",
    "insects", "languages spoken in Europe", "shapes", "farm animals", "breakfast foods",
)  # fmt: skip
TASKS = (
    "Write a short poem about {t}.", "Write one sentence about {t}.",
    "Describe {t} in two sentences.", "Give a fun fact about {t}.",
    "Explain {t} to a child.",
)  # fmt: skip
QUESTIONS = (
    "What is the capital of {c}?", "What language is spoken in {c}?",
    "What is the currency of {c}?", "What is {t}?", "How does {t} work?",
    "Why is {t} important?", "Name three {k}.", "List four {k}.",
    "What are some {k}?", "What is your favorite among {k}, and why?",
)  # fmt: skip
ARITHMETIC = ("What is {a} plus {b}?", "What is {a} times {b}?", "What is {a} minus {b}?")


def eval_questions(path: Path = EVAL_PROMPTS) -> set[str]:
    return {json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()}


def generated_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts (fewer only if the templates run out), in a seeded order."""
    rng = random.Random(seed)
    pool: set[str] = set()
    for template in QUESTIONS + TASKS:
        for c in COUNTRIES:
            for t in THINGS[:8]:
                pool.add(template.format(c=c, t=t, k=rng.choice(CATEGORIES)))
        for t in THINGS:
            pool.add(template.format(c=rng.choice(COUNTRIES), t=t, k=rng.choice(CATEGORIES)))
        for k in CATEGORIES:
            pool.add(template.format(c=rng.choice(COUNTRIES), t=rng.choice(THINGS), k=k))
    for template in ARITHMETIC:
        for a in range(2, 13):
            pool.add(template.format(a=a, b=rng.randint(2, 20)))
    prompts = sorted(pool - eval_questions())
    rng.shuffle(prompts)
    return prompts[:count]


def held_out_prompts(count: int) -> list[str]:
    """The last `count` prompts of the pool in seed 0's order: never among
    `generated_prompts(n, 0)` while n + count <= the pool's size (481), so a drafter trained on
    up to 441 generated prompts at seed 0 can be measured on the last 40
    (`engine.adapt.acceptance`)."""
    pool = generated_prompts(1 << 30, 0)
    return pool[len(pool) - count :] if count > 0 else []
