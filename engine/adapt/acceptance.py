"""How many draft tokens the verifier accepts per verify pass in hybrid mode: the figure a
drafter (the decoder adapter) is trained for.

    python -m engine.adapt.acceptance [--model DIR] [--adapter DIR|auto|none]
        [--questions 21] [--held-out 16] [--max-tokens 64] [--json]

Offline engine, fast numerics, greedy, a draft policy that always drafts (`canvas_cost` ~0:
no request ever falls back to AR steps, so every token after the first comes out of a verify
pass). Prompts, all held out from adapter training: the shipped eval questions
(`data/eval_prompts.jsonl`) and the last `--held-out` generated prompts of the template pool
(`engine.adapt.prompts.held_out_prompts`), chat-formatted. Prints accepted tokens per verify
pass for each set, and the text's agreement with AR's (greedy hybrid is AR's text).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from engine.adapt.evaluate import question_ids
from engine.adapt.prompts import EVAL_PROMPTS, held_out_prompts
from engine.build import adapter_choice
from engine.draft_policy import DraftPolicy
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.scheduler import SchedulerConfig

ALWAYS_DRAFT = DraftPolicy(adaptive=False, canvas_cost=1e-9)
KV_CACHE_TOKENS = 16_384  # ~60 short chat prompts at once; the default pool would take 6 GB


@dataclass(frozen=True, slots=True)
class Acceptance:
    prompts: int
    tokens: int
    verify_passes: int
    accepted: int

    @property
    def per_pass(self) -> float:
        """Draft tokens accepted per verify pass (beyond the pinned pending token)."""
        return self.accepted / max(1, self.verify_passes)


def hybrid_llm(model: Path, adapter: str | Path | bool = True) -> LLM:
    """An offline engine in fast numerics whose hybrid requests always draft."""
    config = EngineConfig(
        scheduler=SchedulerConfig(draft_policy=ALWAYS_DRAFT), kv_cache_tokens=KV_CACHE_TOKENS
    )
    return LLM.from_pretrained(model, config=config, adapter=adapter)


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Acceptance:
    """Greedy hybrid generation of `prompts` (token ids), all submitted at once."""
    params = [
        SamplingParams(mode=DecodeMode.HYBRID, max_tokens=max_tokens, temperature=0.0)
        for _ in prompts
    ]
    outs = llm.generate(prompts, params)
    return Acceptance(
        len(outs),
        sum(len(o.output_ids) for o in outs),
        sum(o.verify_passes for o in outs),
        sum(o.accepted_tokens for o in outs),
    )


def eval_question_prompts(path: Path = EVAL_PROMPTS) -> list[str]:
    lines = path.read_text().splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--adapter", type=adapter_choice, default=True, metavar="DIR|auto|none")
    parser.add_argument("--questions", type=int, default=21, help="eval questions (first N)")
    parser.add_argument("--held-out", type=int, default=16, help="held-out generated prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.checkpoints.default import default_model_dir

        args.model = default_model_dir()
    llm = hybrid_llm(args.model, args.adapter)
    tokenizer = llm.tokenizer
    assert tokenizer is not None, "needs a checkpoint with a tokenizer"
    sets = {
        "eval questions": eval_question_prompts()[: args.questions],
        "held-out generated": held_out_prompts(args.held_out),
    }
    report = {}
    for name, texts in sets.items():
        if not texts:
            continue
        result = measure(llm, [question_ids(tokenizer, t) for t in texts], args.max_tokens)
        report[name] = {
            "prompts": result.prompts,
            "tokens": result.tokens,
            "verify_passes": result.verify_passes,
            "accepted": result.accepted,
            "accepted_per_pass": round(result.per_pass, 3),
        }
    if args.json:
        print(json.dumps(report))
    else:
        print("| prompts | n | tokens | verify passes | accepted | accepted / pass |")
        print("|---|---|---|---|---|---|")
        for name, r in report.items():
            print(
                f"| {name} | {r['prompts']} | {r['tokens']} | {r['verify_passes']} | "
                f"{r['accepted']} | {r['accepted_per_pass']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
