"""What structured outputs cost a step that mixes constrained and free requests.

    python -m loadtest.cpu.structured_bench [--model DIR] [--requests 16] [--max-tokens 96]
    (make bench-structured)

Offline engine (`LLM`), the built-in default model by default (SmolLM2-135M converted: a real
49,152-token vocabulary, so the grammar's masks cost what they would in production). For each
decoding mode, the same N prompts run twice in one batch: all free, then half of them with a
JSON schema (`response_format`). Reports wall time, tokens/s, the engine's step time and the
part of it spent on grammars (`StepStats.grammar_seconds`: masks, canvas repair, closing
estimates), the overhead ratio, and how many constrained outputs parse and validate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import jsonschema

from engine.llm import LLM, RequestOutput
from engine.params import DecodeMode, SamplingParams
from engine.structured import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
}
PROMPT = "Describe a fictional person as a JSON object with name, age, hobbies and pet."


def _run(llm: LLM, params: list[SamplingParams]) -> tuple[list[RequestOutput], dict[str, float]]:
    """Generate and sum the engine's step counters over the run."""
    engine = llm.engine
    totals = {"steps": 0.0, "step_seconds": 0.0, "grammar_seconds": 0.0}
    original = engine.step

    def step():  # type: ignore[no-untyped-def]
        result = original()
        totals["steps"] += 1
        totals["step_seconds"] += result.stats.step_seconds
        totals["grammar_seconds"] += result.stats.grammar_seconds
        return result

    engine.step = step  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        outs = llm.generate([PROMPT] * len(params), params)
        totals["wall_seconds"] = time.perf_counter() - start
    finally:
        engine.step = original  # type: ignore[method-assign]
    totals["tokens"] = float(sum(len(o.output_ids) for o in outs))
    return outs, totals


class RepairCounter:
    """Counts how many committed canvas positions the grammar's repair changed (diffusion):
    how far the model's own drafts are from valid documents."""

    def __init__(self) -> None:
        self.checked = 0
        self.changed = 0
        self._original = Constraint.repair

    def __enter__(self) -> RepairCounter:
        counter, original = self, self._original

        def repair(self: Constraint, draft: list[int], logits: Any, budget: int) -> list[int]:
            out = original(self, draft, logits, budget)
            end = min(len(draft), budget)
            counter.checked += end
            counter.changed += sum(a != b for a, b in zip(draft[:end], out[:end], strict=True))
            return out

        Constraint.repair = repair  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Constraint.repair = self._original  # type: ignore[method-assign]


def _valid(out: RequestOutput) -> bool:
    try:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return out.finish_reason == "stop"


def measure(
    llm: LLM, mode: DecodeMode, requests: int, max_tokens: int, steps: int
) -> dict[str, Any]:
    def params(i: int, schema: bool) -> SamplingParams:
        return SamplingParams(
            mode=mode,
            seed=i,
            max_tokens=max_tokens,
            max_denoising_steps=steps,
            temperature=0.7,
            json_schema=json.dumps(SCHEMA) if schema else None,
        )

    llm.generate([PROMPT], [params(0, True)])  # warm-up (and the tokenizer's grammar build)
    _, free = _run(llm, [params(i, False) for i in range(requests)])
    with RepairCounter() as repairs:
        outs, mixed = _run(llm, [params(i, i % 2 == 0) for i in range(requests)])
    constrained = [o for i, o in enumerate(outs) if i % 2 == 0]
    return {
        "mode": mode.value,
        "free": free,
        "mixed": mixed,
        "step_ms_free": 1000 * free["step_seconds"] / max(free["steps"], 1),
        "step_ms_mixed": 1000 * mixed["step_seconds"] / max(mixed["steps"], 1),
        "grammar_ms_per_step": 1000 * mixed["grammar_seconds"] / max(mixed["steps"], 1),
        "grammar_share": mixed["grammar_seconds"] / max(mixed["step_seconds"], 1e-9),
        "tok_s_free": free["tokens"] / free["wall_seconds"],
        "tok_s_mixed": mixed["tokens"] / mixed["wall_seconds"],
        "valid": f"{sum(map(_valid, constrained))}/{len(constrained)}",
        "repaired": repairs.changed / repairs.checked if repairs.checked else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--denoising-steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=Path("bench-out/structured.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.checkpoints.default import default_model_dir

        args.model = default_model_dir()
    llm = LLM.from_pretrained(args.model)
    rows = [
        measure(llm, mode, args.requests, args.max_tokens, args.denoising_steps)
        for mode in (DecodeMode.AR, DecodeMode.DIFFUSION)
    ]
    print(f"# structured outputs: {args.requests} requests (half constrained), {args.model.name}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(
        "| mode | step ms free | step ms mixed | grammar ms/step | grammar share | tok/s free "
        "| tok/s mixed | valid | positions repaired |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        repaired = "–" if r["repaired"] is None else f"{100 * r['repaired']:.1f}%"
        print(
            f"| {r['mode']} | {r['step_ms_free']:.1f} | {r['step_ms_mixed']:.1f} | "
            f"{r['grammar_ms_per_step']:.1f} | {100 * r['grammar_share']:.1f}% | "
            f"{r['tok_s_free']:.1f} | {r['tok_s_mixed']:.1f} | {r['valid']} | {repaired} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
