"""Hybrid decoding against AR mode (`make bench-hybrid`), one request at a time and N at once.

    python -m loadtest.cpu.hybrid_bench [--model DIR] [--questions 6] [--concurrency 16]
        [--max-tokens 48] [--rounds 2]

Offline engine (`LLM`), fast numerics, greedy, the built-in default model by default (its
shipped decoder adapter is the drafter), chat-formatted eval questions
(`engine/adapt/data/eval_prompts.jsonl`). Three configurations: AR mode; hybrid with the
adaptive draft policy (the default: measured step cost, every request's acceptance); hybrid
with the per-request policy (`DraftPolicy(adaptive=False)`). Each configuration has its own
engine, warmed by a full round that is not timed; then `--rounds` rounds, each running every
configuration back to back at 1 and at N concurrent, and the ratios to AR are taken within a
round (this machine's speed drifts between minutes). Prints tokens/s, the ratio to AR, TPF
(tokens per model forward), verify passes, accepted tokens and whether the text equals AR's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.adapt.evaluate import question_ids
from engine.draft_policy import DraftPolicy
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.scheduler import SchedulerConfig
from loadtest.machine import hardware

QUESTIONS = Path(__file__).resolve().parents[2] / "engine" / "adapt" / "data"
CONFIGS = ("ar", "hybrid-adaptive", "hybrid-per-request")


@dataclass(frozen=True, slots=True)
class Run:
    tokens: int
    seconds: float
    forwards: int
    verify_passes: int
    accepted: int
    outputs: tuple[tuple[int, ...], ...]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tpf(self) -> float:
        return self.tokens / max(1, self.forwards)


def run(llm: LLM, mode: DecodeMode, prompts: list[list[int]], max_tokens: int) -> Run:
    params = [SamplingParams(mode=mode, max_tokens=max_tokens, temperature=0.0) for _ in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    return Run(
        sum(len(o.output_ids) for o in outs),
        seconds,
        sum(o.decoder_passes + o.encoder_passes for o in outs),
        sum(o.verify_passes for o in outs),
        sum(o.accepted_tokens for o in outs),
        tuple(tuple(o.output_ids) for o in outs),
    )


def one_at_a_time(llm: LLM, mode: DecodeMode, prompts: list[list[int]], max_tokens: int) -> Run:
    parts = [run(llm, mode, [p], max_tokens) for p in prompts]
    return Run(
        sum(r.tokens for r in parts),
        sum(r.seconds for r in parts),
        sum(r.forwards for r in parts),
        sum(r.verify_passes for r in parts),
        sum(r.accepted for r in parts),
        tuple(o for r in parts for o in r.outputs),
    )


def engines(model: Path) -> dict[str, tuple[LLM, DecodeMode]]:
    def load(adaptive: bool) -> LLM:
        policy = DraftPolicy(adaptive=adaptive)
        return LLM.from_pretrained(
            model, config=EngineConfig(scheduler=SchedulerConfig(draft_policy=policy))
        )

    adaptive = load(True)
    return {
        "ar": (adaptive, DecodeMode.AR),  # AR rows never consult the draft policy
        "hybrid-adaptive": (load(True), DecodeMode.HYBRID),
        "hybrid-per-request": (load(False), DecodeMode.HYBRID),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--questions", type=int, default=6, help="prompts one at a time (0: none)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.checkpoints.default import default_model_dir

        args.model = default_model_dir()
    llms = engines(args.model)
    tokenizer = llms["ar"][0].tokenizer
    assert tokenizer is not None, "the benchmark needs a checkpoint with a tokenizer"
    lines = (QUESTIONS / "eval_prompts.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines if line.strip()]
    wanted = max(args.questions, args.concurrency)
    prompts = [question_ids(tokenizer, questions[i % len(questions)]) for i in range(wanted)]
    shapes = {1: prompts[: args.questions], args.concurrency: prompts[: args.concurrency]}
    shapes = {c: batch for c, batch in shapes.items() if batch}  # --questions 0: skip one-by-one
    hw = hardware()
    print(f"# hybrid vs AR: {args.model.name}, {hw['cpu']} ({hw['cpu_count']} CPUs)")
    print(f"# command: python -m loadtest.cpu.hybrid_bench {' '.join(sys.argv[1:])}".rstrip())
    print(f"# greedy, fast numerics, max_tokens {args.max_tokens}; round 0 is the warm-up\n")
    print("| concurrency | round | configuration | tok/s | vs AR | TPF | verify | accepted", end="")
    print(" | text = AR |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[int, str], list[float]] = {}
    for concurrency, batch in shapes.items():
        for rnd in range(args.rounds + 1):
            results = {}
            for name in CONFIGS:
                llm, mode = llms[name]
                go = one_at_a_time if concurrency == 1 else run
                results[name] = go(llm, mode, batch, args.max_tokens)
            if rnd == 0:
                continue
            ar = results["ar"]
            for name, r in results.items():
                ratio = r.tok_s / ar.tok_s
                ratios.setdefault((concurrency, name), []).append(ratio)
                same = sum(a == b for a, b in zip(r.outputs, ar.outputs, strict=True))
                print(
                    f"| {concurrency} | {rnd} | {name} | {r.tok_s:.1f} | {ratio:.2f}x | "
                    f"{r.tpf:.2f} | {r.verify_passes} | {r.accepted} | {same}/{len(ar.outputs)} |"
                )
    print("\n| concurrency | configuration | median vs AR | min | max |")
    print("|---|---|---|---|---|")
    for (concurrency, name), values in ratios.items():
        print(
            f"| {concurrency} | {name} | {statistics.median(values):.2f}x | "
            f"{min(values):.2f}x | {max(values):.2f}x |"
        )
    cost = llms["hybrid-adaptive"][0].engine.scheduler
    fit = cost.step_cost.fit()
    if fit is not None:
        print(
            f"\nadaptive policy's step-cost fit: {fit[0] * 1e3:.1f} ms fixed + "
            f"{fit[1] * 1e3:.2f} ms per token; acceptance prior {cost.accept_prior}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
