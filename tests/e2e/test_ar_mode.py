"""AR mode: token-by-token decoding from the encoder's logits."""

from __future__ import annotations

import torch

from engine import LLM, DecodeMode, SamplingParams
from loadtest.cpu.reference import greedy_ar


def reference_greedy(ref, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The benchmark's plain greedy loop over the reference encoder's soft-capped logits."""
    return greedy_ar(ref, torch.tensor([prompt]), None, max_tokens, frozenset(eos))[0]


def test_ar_greedy_matches_a_greedy_loop_over_reference_encoder_logits(
    tiny_checkpoint, reference_model
):
    for preset in ("c16", "c32-window"):
        path = tiny_checkpoint(preset)
        ref, llm = reference_model(path), LLM.from_pretrained(path, exact=True)
        eos = set(llm.defaults.eos_token_ids)
        for prompt in ([7], [9, 30, 41, 2, 77], list(range(40, 60))):
            (out,) = llm.generate(prompt, SamplingParams(mode=DecodeMode.AR, max_tokens=24))
            assert out.output_ids == reference_greedy(ref, prompt, 24, eos)
            assert out.decoder_passes == 0 and out.tokens_per_forward == 1.0


def test_ar_sampling_is_seeded(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    prompt = [4, 5, 6]

    def run(seed: int) -> list[int]:
        params = SamplingParams(mode=DecodeMode.AR, max_tokens=16, temperature=1.5, seed=seed)
        return llm.generate(prompt, params)[0].output_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_ar_stops_at_eos(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    free = llm.generate([4, 5, 6], SamplingParams(mode=DecodeMode.AR, max_tokens=12))[0].output_ids
    eos = free[5]
    cut = llm.generate(
        [4, 5, 6], SamplingParams(mode=DecodeMode.AR, max_tokens=12, eos_token_ids=(eos,))
    )[0]
    assert cut.output_ids == free[: free.index(eos) + 1]
    assert cut.finish_reason == "stop"
