"""The exact-numerics parity sweep: random DiffusionGemma configurations x seeds x CPU thread
counts, Canvas' `LLM(exact=True)` against the transformers reference `generate()`.

Each case is a random tiny checkpoint (`random_case`) and a random prompt. For each thread count
(`torch.set_num_threads`, on both sides) both engines generate a few canvases with the same seed
and the same denoising-step cap; a case passes when Canvas emits the reference's tokens (up to
the first EOS) and every decoder pass produced bit-identical logits, in order. Comparing the
logits as well catches a difference in the last bit long before it flips a token.

`make parity-sweep` runs hundreds of cases (`python -m tests.parity_sweep --cases 300`);
`tests/e2e/test_parity_sweep.py` runs a small fixed sample in `make test`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

THREAD_COUNTS = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class SweepCase:
    """One random configuration and the request run on it."""

    index: int
    text: dict[str, Any]
    canvas_length: int
    prompt: list[int]
    seed: int
    num_canvases: int
    denoising_steps: int

    def describe(self) -> str:
        t = self.text
        return (
            f"case {self.index}: {t['num_hidden_layers']} layers, canvas {self.canvas_length}, "
            f"hidden {t['hidden_size']}, heads {t['num_attention_heads']}/"
            f"{t['num_key_value_heads']} (full {t['num_global_key_value_heads']} kv, "
            f"head_dim {t['head_dim']}/{t['global_head_dim']}), window {t['sliding_window']}, "
            f"experts {t['num_experts']} top-{t['top_k_experts']}, vocab {t['vocab_size']}, "
            f"eos {t['eos_token_id']}, prompt {len(self.prompt)}, seed {self.seed}"
        )


@dataclass(slots=True)
class CaseResult:
    case: SweepCase
    mismatches: dict[int, str] = field(default_factory=dict)  # thread count -> what differed

    @property
    def ok(self) -> bool:
        return not self.mismatches


def random_case(index: int) -> SweepCase:
    """The sweep's case `index` (the same for every run): layers 2-12, canvas 8-64, a sliding
    window shorter or longer than the prompt, 2-16 experts with top-1 to top-4, GQA or MHA,
    full-attention layers with their own head dim and KV heads, one to three EOS ids."""
    rng = random.Random(f"canvas-parity-{index}")
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])  # kv == heads: MHA
    global_kv = rng.choice([h for h in (1, 2, 4) if heads % h == 0 and h != kv] or [kv])
    head_dim = rng.choice([8, 16, 32])
    vocab = rng.choice([256, 512, 1024])
    experts = rng.randint(2, 16)
    window = rng.choice([4, 8, 16, 32, 64])
    prompt_len = rng.choice([rng.randint(1, window), rng.randint(window + 1, 3 * window + 8)])
    eos = [1] + rng.sample(range(3, vocab), rng.randint(0, 2))
    text = {
        "num_hidden_layers": rng.randint(2, 12),
        "hidden_size": rng.choice([32, 64, 128]),
        "intermediate_size": rng.choice([48, 64, 128]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_global_key_value_heads": global_kv,
        "head_dim": head_dim,
        "global_head_dim": 2 * head_dim,  # full layers differ from sliding ones in both
        "sliding_window": window,
        "num_experts": experts,
        "top_k_experts": rng.randint(1, min(4, experts)),
        "moe_intermediate_size": rng.choice([16, 32]),
        "vocab_size": vocab,
        "eos_token_id": eos,
    }
    return SweepCase(
        index=index,
        text=text,
        canvas_length=rng.choice([8, 12, 16, 24, 32, 48, 64]),
        prompt=[rng.randint(3, vocab - 1) for _ in range(prompt_len)],
        seed=rng.randint(0, 2**31 - 1),
        num_canvases=rng.randint(2, 3),
        denoising_steps=rng.choice([6, 12]),
    )


def _recording(fn: Any, log: list[torch.Tensor], pick: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        log.append(pick(out).detach().clone())
        return out

    return call


def run_case(case: SweepCase, threads: Sequence[int], workdir: Path) -> CaseResult:
    """Build the case's checkpoint and compare both engines at each thread count."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from engine import LLM, SamplingParams
    from engine.checkpoints.tiny import make_tiny

    path = make_tiny(
        workdir / f"case-{case.index}",
        seed=case.index,
        text_overrides=case.text,
        canvas_length=case.canvas_length,
    )
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    llm = LLM.from_pretrained(path, exact=True)
    ref_logits: list[torch.Tensor] = []
    our_logits: list[torch.Tensor] = []
    ref.forward = _recording(ref.forward, ref_logits, lambda out: out.logits[0])
    llm.model.logits = _recording(llm.model.logits, our_logits, lambda out: out)  # type: ignore[method-assign]
    max_tokens = case.num_canvases * case.canvas_length
    eos = set(case.text["eos_token_id"])
    result = CaseResult(case)
    before = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            ref_logits.clear()
            our_logits.clear()
            torch.manual_seed(case.seed)
            with torch.no_grad():
                sequences = ref.generate(
                    torch.tensor([case.prompt]),
                    max_new_tokens=max_tokens,
                    max_denoising_steps=case.denoising_steps,
                ).sequences
            want = []
            for token in sequences[0, len(case.prompt) :].tolist():
                want.append(token)
                if token in eos:
                    break
            params = SamplingParams(
                max_tokens=max_tokens, seed=case.seed, max_denoising_steps=case.denoising_steps
            )
            (out,) = llm.generate(case.prompt, params)
            problem = compare(want, out.output_ids, ref_logits, our_logits)
            if problem:
                result.mismatches[count] = problem
    finally:
        torch.set_num_threads(before)
    return result


def compare(
    want: list[int], got: list[int], ref_logits: list[torch.Tensor], our_logits: list[torch.Tensor]
) -> str:
    """'' when tokens and every decoder pass's logits agree; else what differed first."""
    for step, (a, b) in enumerate(zip(ref_logits, our_logits, strict=False)):
        if a.shape != b.shape or not torch.equal(a, b):
            diff = float((a - b).abs().max()) if a.shape == b.shape else float("nan")
            return f"decoder pass {step}: logits differ (max |diff| {diff:.3g})"
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        return f"tokens differ from position {first} ({len(got)} vs {len(want)} tokens)"
    if len(ref_logits) != len(our_logits):
        return f"{len(our_logits)} decoder passes, the reference made {len(ref_logits)}"
    return ""


def sweep(indices: Sequence[int], threads: Sequence[int], log: Any = None) -> list[CaseResult]:
    """Run the cases; `log(line)` hears one line per case."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    results = []
    with tempfile.TemporaryDirectory(prefix="canvas-parity-") as tmp:
        for index in indices:
            result = run_case(random_case(index), threads, Path(tmp))
            results.append(result)
            if log is not None:
                verdict = "ok" if result.ok else f"MISMATCH {result.mismatches}"
                log(f"{result.case.describe()}: {verdict}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="number of random cases")
    parser.add_argument("--first", type=int, default=0, help="index of the first case")
    parser.add_argument(
        "--threads",
        default=",".join(map(str, THREAD_COUNTS)),
        help="comma-separated CPU thread counts, each run on both sides",
    )
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    started = time.perf_counter()
    results = sweep(range(args.first, args.first + args.cases), threads, print)
    bad = [r for r in results if not r.ok]
    print(
        f"parity sweep: {len(results)} cases x threads {threads}: {len(bad)} mismatching "
        f"({time.perf_counter() - started:.0f} s)"
    )
    for r in bad:
        print(f"  {r.case.describe()}: {r.mismatches}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
