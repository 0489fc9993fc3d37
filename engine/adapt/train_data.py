"""Training data for `canvas train`: (context, canvas) examples.

Every source becomes a list of `TrainSequence`s: token ids plus the positions where a training
canvas may start. An example is one (sequence, start) pair: the context is `ids[:start]`, the
canvas the next `canvas_length` ids, filled with EOS past the end of a finished sequence (the
sampler cuts a committed canvas at its first EOS, so "everything after the end is EOS" is what
the decoder should learn there).

A sequence cut short by a token budget (an unfinished self-distilled completion) is not
EOS-filled: canvas positions past its end have no target (`Example.num_known`).

Sources:
- a `.txt` file: one token stream cut into windows of `context_length + canvas_length` tokens,
  each with BOS first and the canvas at `context_length`;
- a `.jsonl` file, one object a line: {"prompt", "completion"} (the prompt wrapped in the chat
  template when the checkpoint has one, canvases at canvas boundaries after it, as at inference),
  {"text"} (a document: a canvas may start anywhere) or {"prompt_ids", "completion_ids"}
  (already tokenized; what self-distillation writes);
- self-distillation: the model's own AR completions of the prompts in
  `engine/adapt/data/distill_prompts.jsonl`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.inputs.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
DISTILL_PROMPTS = DATA_DIR / "distill_prompts.jsonl"
DISTILL_CHUNK = 64  # prompts per `generate` call when distillation has a deadline


@dataclass(frozen=True, slots=True)
class DataSpec:
    """How sequences are cut into examples."""

    canvas_length: int
    context_length: int  # window context of .txt data; the longest context of any example
    eos_id: int  # ends finished sequences and fills canvases past their end
    bos_id: int | None

    def __post_init__(self) -> None:
        if self.canvas_length < 1 or self.context_length < 1:
            raise ValueError("canvas_length and context_length must be >= 1")


@dataclass(frozen=True, slots=True)
class TrainSequence:
    """Token ids and the positions where a training canvas may start (each >= 1, < len(ids))."""

    ids: tuple[int, ...]
    starts: tuple[int, ...]
    finished: bool = True  # False: cut by a token budget; nothing is known past the end


@dataclass(frozen=True, slots=True)
class Example:
    context: tuple[int, ...]  # at least one token
    canvas: tuple[int, ...]  # exactly canvas_length tokens
    num_known: int  # canvas[:num_known] are real targets; the rest are placeholders (>= 1)


def strip_bos(ids: list[int], bos_id: int | None) -> list[int]:
    return ids[1:] if ids and bos_id is not None and ids[0] == bos_id else ids


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A user prompt as the model sees it at serving time: chat-templated when it can be."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    except ValueError:  # no chat template: a base model takes the text as is
        return tokenizer.encode(text)


def chat_sequence(
    prompt_ids: list[int], completion_ids: list[int], spec: DataSpec, finished: bool = True
) -> TrainSequence | None:
    """Prompt + completion (+ EOS when `finished` and not already there); canvases start at the
    canvas boundaries after the prompt, as at inference. None when there is no canvas."""
    ids = list(prompt_ids) + list(completion_ids)
    if finished and (not completion_ids or completion_ids[-1] != spec.eos_id):
        ids.append(spec.eos_id)
    starts = tuple(range(len(prompt_ids), len(ids), spec.canvas_length))
    if not prompt_ids or not starts:
        return None
    return TrainSequence(tuple(ids), starts, finished)


def every_position(seq: TrainSequence) -> TrainSequence | None:
    """`seq` with a canvas starting at every position from its first start to its
    second-to-last token (a canvas needs a token after slot 0): where hybrid decoding drafts,
    since a pending token can be anywhere. None when there is no such position."""
    starts = tuple(range(seq.starts[0], len(seq.ids) - 1))
    return TrainSequence(seq.ids, starts, seq.finished) if starts else None


def document_sequence(ids: list[int], spec: DataSpec) -> TrainSequence | None:
    """A finished document: a canvas may start after any position."""
    ids = [*ids, spec.eos_id]
    return TrainSequence(tuple(ids), tuple(range(1, len(ids)))) if len(ids) > 1 else None


def text_windows(stream: list[int], spec: DataSpec) -> list[TrainSequence]:
    """Cut a token stream (without BOS) into BOS + context + canvas windows."""
    bos = [spec.bos_id] if spec.bos_id is not None else []
    width = spec.context_length - len(bos) + spec.canvas_length
    if spec.context_length <= len(bos) or len(stream) < width:
        raise ValueError(
            f"--data: the text has {len(stream)} tokens; one window needs {width} "
            f"(--context-length {spec.context_length} + --canvas-length {spec.canvas_length})"
        )
    return [
        TrainSequence(tuple(bos + stream[i : i + width]), (spec.context_length,))
        for i in range(0, len(stream) - width + 1, width)
    ]


def _jsonl_sequence(
    record: dict[str, Any], tokenizer: Tokenizer | None, spec: DataSpec, where: str
) -> TrainSequence | None:
    if "prompt_ids" in record and "completion_ids" in record:
        return chat_sequence(
            record["prompt_ids"], record["completion_ids"], spec, record.get("finished", True)
        )
    if tokenizer is None:
        raise ValueError(f"{where}: text records need a checkpoint with a tokenizer")
    if "prompt" in record and "completion" in record:
        completion = strip_bos(tokenizer.encode(record["completion"], markup=True), spec.bos_id)
        return chat_sequence(encode_prompt(tokenizer, record["prompt"]), completion, spec)
    if "text" in record:
        return document_sequence(tokenizer.encode(record["text"], markup=True), spec)
    raise ValueError(
        f'{where}: expected {{"prompt", "completion"}}, {{"text"}} or '
        f'{{"prompt_ids", "completion_ids"}}, got keys {sorted(record)}'
    )


def load_data_file(path: Path, tokenizer: Tokenizer | None, spec: DataSpec) -> list[TrainSequence]:
    """Read a .txt or .jsonl training file (see the module docstring)."""
    if not path.is_file():
        raise ValueError(f"--data: {path} is not a file")
    if path.suffix == ".txt":
        if tokenizer is None:
            raise ValueError(f"--data {path}: a .txt file needs a checkpoint with a tokenizer")
        text = tokenizer.encode(path.read_text(), markup=True)
        return text_windows(strip_bos(text, spec.bos_id), spec)
    if path.suffix != ".jsonl":
        raise ValueError(f"--data {path}: expected a .txt or .jsonl file")
    sequences = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"--data {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        seq = _jsonl_sequence(record, tokenizer, spec, where)
        if seq is not None:
            sequences.append(seq)
    if not sequences:
        raise ValueError(f"--data {path}: no usable records")
    return sequences


def read_prompts(path: Path = DISTILL_PROMPTS) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def self_distill(
    llm: LLM,
    max_tokens: int,
    temperature: float,
    seed: int,
    path: Path = DISTILL_PROMPTS,
    extra_prompts: list[str] | None = None,
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """The model's own AR completions of the shipped chat prompts (and `extra_prompts`), as
    {"prompt_ids", "completion_ids", "finished"} records (`llm`: an `engine.LLM` with a
    tokenizer). With a `deadline` (`time.monotonic()`), prompts go in chunks of
    `DISTILL_CHUNK` and no chunk starts after it: the shipped prompts first, at least one
    chunk."""
    from engine.params import DecodeMode, SamplingParams

    if llm.tokenizer is None:
        raise ValueError("--self-distill needs a checkpoint with a tokenizer")
    texts = read_prompts(path) + list(extra_prompts or [])
    prompts = [encode_prompt(llm.tokenizer, text) for text in texts]
    params = [
        SamplingParams(
            max_tokens=max_tokens, mode=DecodeMode.AR, seed=seed + i, temperature=temperature
        )
        for i in range(len(prompts))
    ]
    logger.info("Self-distillation: %d AR completions of up to %d tokens", len(prompts), max_tokens)
    chunk = len(prompts) if deadline is None else DISTILL_CHUNK
    outputs: list[RequestOutput] = []
    for first in range(0, len(prompts), max(chunk, 1)):
        if outputs and deadline is not None and time.monotonic() >= deadline:
            logger.warning("Distillation budget spent: %d of %d prompts", first, len(prompts))
            break
        outputs += llm.generate(prompts[first : first + chunk], params[first : first + chunk])
    return [
        {
            "prompt_ids": o.prompt_ids,
            "completion_ids": o.output_ids,
            "finished": o.finish_reason == "stop",
        }
        for o in outputs
    ]


class ExampleSampler:
    """Draws examples uniformly over all (sequence, start) pairs with a private generator."""

    def __init__(self, sequences: list[TrainSequence], spec: DataSpec) -> None:
        self.sequences = sequences
        self.spec = spec
        self.pairs = [(i, s) for i, seq in enumerate(sequences) for s in seq.starts]
        if not self.pairs:
            raise ValueError("the training data yields no examples")

    def example(self, index: int) -> Example:
        seq_index, start = self.pairs[index]
        seq, spec = self.sequences[seq_index], self.spec
        ids = seq.ids
        context = ids[:start]
        if len(context) > spec.context_length:
            # Keep BOS (the model always saw one first) and the most recent tokens.
            keep_bos = spec.bos_id is not None and context[0] == spec.bos_id
            head = context[:1] if keep_bos else ()
            context = head + context[len(context) - spec.context_length + len(head) :]
        canvas = ids[start : start + spec.canvas_length]
        num_known = spec.canvas_length if seq.finished else len(canvas)
        canvas += (spec.eos_id,) * (spec.canvas_length - len(canvas))
        return Example(context, canvas, num_known)

    def draw(self, batch_size: int, generator: torch.Generator) -> list[int]:
        """Indices into `pairs` of one batch (`sample` builds their examples)."""
        picks = torch.randint(0, len(self.pairs), (batch_size,), generator=generator)
        return [int(i) for i in picks]

    def sample(self, batch_size: int, generator: torch.Generator) -> list[Example]:
        return [self.example(i) for i in self.draw(batch_size, generator)]
