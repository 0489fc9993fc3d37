"""Serving over ranks samples through the vocabulary-sharded sampler
(`engine.parallel.sampling`), over CPU processes (gloo), end to end over HTTP: rank 0 holds
only its vocabulary slice of the embedding (the tied LM head's rows), the logits of requests
without a feature that reads whole rows are never all-gathered (the collectives' payloads are
recorded: the sampler's statistics and picked ids, no vocabulary slice; an AR grammar's mask
goes to the ranks as bits), and the features
that act on the logits give TP=1's greedy answers under TP=2: logit_bias (ids in either
rank's slice), the penalties, a json_schema, the top_k filter, log-probabilities with
top_logprobs; a decisive bias on a token of rank 1's slice changes the answer alike in AR and
diffusion without any row gathered; a diffusion canvas whose log-probabilities are wanted is
gathered once, after its last step; a diffusion json_schema answer parses."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from engine.parallel.sampling import ShardedSampling
from loadtest.load.inprocess import ServerHandle, serve_in_thread
from tests.e2e.serve_cases import GREEDY, assert_same_greedy, chat, near_tie_bound

PRESET = "c32-window"  # vocabulary 512: rank 0 holds ids [0, 256), rank 1 [256, 512)
FLAGS = ("--device", "cpu", "--kernels", "twins")
RANK1_TOKEN = "300"  # an id in rank 1's slice
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def one(checkpoint: Path) -> Iterator[ServerHandle]:
    with serve_in_thread(checkpoint, FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def tp2(checkpoint: Path) -> Iterator[ServerHandle]:
    with serve_in_thread(checkpoint, (*FLAGS, "--tensor-parallel-size", "2")) as server:
        yield server


def record_collectives(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Rank 0's collectives from now on (it runs in this process): (kind, input shape)."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    gather, reduce = dist.all_gather, dist.all_reduce

    def all_gather(parts: list[torch.Tensor], x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append(("gather", tuple(x.shape)))
        return gather(parts, x, *args, **kw)

    def all_reduce(x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append(("reduce", tuple(x.shape)))
        return reduce(x, *args, **kw)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def test_rank0_holds_its_slice_and_plain_requests_gather_no_logits(
    tp2: ServerHandle, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tp2.state.engine.engine
    assert isinstance(engine.sampling, ShardedSampling)
    (weights,) = [load_file(p) for p in checkpoint.glob("*.safetensors")]
    (whole,) = [t for name, t in weights.items() if name.endswith("embed_tokens.weight")]
    vocab, held = whole.shape[0], engine.model.embed_tokens.weight
    assert held.shape[0] == vocab // 2 and torch.equal(held, whole[: vocab // 2])
    seen = record_collectives(monkeypatch)
    chat(tp2, "Tell me a story.", mode="diffusion", seed=5, max_tokens=40)
    chat(tp2, "What is 2 + 2?", mode="ar", seed=5, temperature=0.8, max_tokens=8)
    chat(tp2, "hello there", mode="ar", temperature=0, max_tokens=8, logit_bias={"40": 3})
    grammar = FEATURES["json_schema"]["response_format"]
    chat(tp2, "hi", mode="ar", temperature=0.5, max_tokens=8, response_format=grammar)
    slices = [shape for kind, shape in seen if kind == "gather" and shape[-1] == vocab // 2]
    assert not slices, "a plain request's logits were gathered"
    stats = [shape for kind, shape in seen if kind == "gather" and shape[-1] == 3]
    assert len(stats) >= 10  # every sampled step's statistics: the sharded sampler ran
    assert max(x for kind, shape in seen for x in shape) < vocab // 2
    # log-probabilities read their rows whole: those rows alone are gathered, one per token
    seen.clear()
    answer = chat(tp2, "hello there", mode="ar", temperature=0, max_tokens=4, logprobs=True)
    tokens = len(answer["choices"][0]["logprobs"]["content"])
    slices = [shape for kind, shape in seen if kind == "gather" and shape[-1] == vocab // 2]
    assert slices == [(1, vocab // 2)] * tokens


FEATURES = {
    "logit_bias": {"logit_bias": {RANK1_TOKEN: 9.0, "70": 4.0, "75": -20.0}},
    "penalties": {"repetition_penalty": 1.6, "frequency_penalty": 0.8, "presence_penalty": 0.5},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        "max_tokens": 48,
    },
    "top_k": {"temperature": 2.0, "top_k": 1, "seed": 1},  # one candidate: the argmax
    "top_logprobs": {"top_logprobs": 5},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_at_tp2_give_tp1s_greedy_answer(
    one: ServerHandle, tp2: ServerHandle, checkpoint: Path, feature: str
) -> None:
    body = {**GREEDY, **FEATURES[feature]}
    ours = chat(tp2, "Tell me a story.", **body)["choices"][0]
    ref = chat(one, "Tell me a story.", **body)["choices"][0]
    assert_same_greedy(ours, ref, near_tie_bound(checkpoint))
    if feature == "json_schema":
        assert set(json.loads(ours["message"]["content"])) == {"name", "age"}
    if feature == "top_logprobs":
        assert all(len(t["top_logprobs"]) == 5 for t in ours["logprobs"]["content"])


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_decisive_bias_in_rank1s_slice_is_applied_without_gathering(
    one: ServerHandle, tp2: ServerHandle, mode: str
) -> None:
    """No feature reads the rows whole here: the bias reaches rank 1's columns as an edit."""
    body = {"mode": mode, "seed": 2, "max_tokens": 6, "temperature": 0}
    plain = chat(tp2, "hello there", **body)["choices"][0]["message"]["content"]
    body["logit_bias"] = {RANK1_TOKEN: 100.0}
    ours = chat(tp2, "hello there", **body)["choices"][0]["message"]["content"]
    assert ours == chat(one, "hello there", **body)["choices"][0]["message"]["content"]
    assert ours != plain


def test_a_canvas_read_whole_is_gathered_once_it_converged(
    one: ServerHandle,
    tp2: ServerHandle,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Diffusion with log-probabilities: the canvas's rows are gathered once, after its last
    step, not at each step; the answer (a decisive bias: no rounding can move a token) and its
    log-probabilities are TP=1's."""
    body = {"mode": "diffusion", "seed": 4, "max_tokens": 32, "logprobs": True}
    body |= {"top_logprobs": 2, "logit_bias": {RANK1_TOKEN: 100.0}}
    seen = record_collectives(monkeypatch)
    ours = chat(tp2, "hello there", **body)["choices"][0]
    vocab = tp2.state.engine.engine.model.cfg.vocab_size
    slices = [shape for kind, shape in seen if kind == "gather" and shape[-1] == vocab // 2]
    steps = [shape for kind, shape in seen if kind == "gather" and shape[-1] == 3]
    assert slices == [(32, vocab // 2)] and len(steps) > 1
    assert_same_greedy(
        ours, chat(one, "hello there", **body)["choices"][0], near_tie_bound(checkpoint)
    )


def test_a_diffusion_json_schema_is_repaired_from_its_gathered_rows(tp2: ServerHandle) -> None:
    grammar = FEATURES["json_schema"]["response_format"]

    def answer(seed: int) -> str:
        body = {"mode": "diffusion", "seed": seed, "max_tokens": 64, "response_format": grammar}
        return chat(tp2, "Describe a person.", **body)["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(3) as pool:  # one step serves the three canvases
        for text in pool.map(answer, range(3)):
            assert set(json.loads(text)) == {"name", "age"}
