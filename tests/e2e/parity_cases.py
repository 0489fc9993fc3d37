"""What the end-to-end parity tests share: their prompts, a reference generate() run, and the
prefix of the reference's tokens Canvas must emit."""

from __future__ import annotations

import torch

from engine import LLM


def prompts_for(llm: LLM) -> list[list[int]]:
    """Five prompts: one token, short ones, and one longer than the sliding window."""
    vocab, window = llm.model.cfg.vocab_size, llm.model.cfg.sliding_window
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 4, 9, 17, 2 * window + 1]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def reference_generate(ref, prompt: list[int], seed: int, **kwargs) -> tuple[list[int], float]:
    torch.manual_seed(seed)
    out = ref.generate(torch.tensor([prompt]), **kwargs)
    return out.sequences[0, len(prompt) :].tolist(), float(out.tokens_per_forward[0])


def expected_prefix(ref_ids: list[int], eos: set[int], max_tokens: int) -> list[int]:
    """What Canvas must emit: the reference's tokens up to and including the first EOS, and
    never more than max_tokens (the reference always emits whole canvases)."""
    for i, token in enumerate(ref_ids[:max_tokens]):
        if token in eos:
            return ref_ids[: i + 1]
    return ref_ids[:max_tokens]
