"""The `canvas` command line: serve (HTTP), generate (offline), make-tiny (test checkpoints)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canvas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline for one prompt and print stats")
    gen.add_argument("--model", required=True, help="checkpoint directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 2,15,9")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--mode", choices=["diffusion", "ar"], default="diffusion")
    gen.add_argument("--temperature", type=float, default=None, help="AR mode only (0 = greedy)")
    gen.add_argument("--max-denoising-steps", type=int, default=None)
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight DiffusionGemma checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", default=None, help="preset name (see --list)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--list", action="store_true", help="list the presets and exit")

    from server.serve import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="start the OpenAI-compatible HTTP server"))
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, DecodeMode, ParamError, SamplingParams
    from engine.model import CheckpointError

    try:
        llm = LLM.from_pretrained(args.model, dtype=args.dtype)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            seed=args.seed,
            mode=DecodeMode(args.mode),
            temperature=args.temperature,
            max_denoising_steps=args.max_denoising_steps,
        )
        if args.prompt_ids is not None:
            prompt: str | list[int] = args.prompt_ids
        elif args.chat:
            if llm.tokenizer is None:
                raise ParamError("prompt", "this checkpoint has no tokenizer")
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        else:
            prompt = args.prompt
        (out,) = llm.generate(prompt, params)
    except (CheckpointError, ParamError, ValueError) as exc:
        print(f"canvas generate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "output_ids": out.output_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "decoder_passes": out.decoder_passes,
                    "steps_per_canvas": out.steps_per_canvas,
                    "tokens_per_forward": out.tokens_per_forward,
                    "seconds": out.seconds,
                }
            )
        )
        return 0
    print(out.text if llm.tokenizer is not None else ",".join(map(str, out.output_ids)))
    print(
        f"\n[{len(out.output_ids)} tokens, finish={out.finish_reason}, decoder passes="
        f"{out.decoder_passes}, steps per canvas={out.steps_per_canvas}, tokens per forward="
        f"{out.tokens_per_forward:.3f}, {out.seconds:.2f} s]",
        file=sys.stderr,
    )
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import DEFAULT_PRESET, PRESETS, make_tiny

    if args.list:
        for name, preset in PRESETS.items():
            print(f"{name:12s} {preset.description}")
        return 0
    preset = args.preset or DEFAULT_PRESET
    if preset not in PRESETS:
        print(
            f"canvas make-tiny: error: unknown preset {preset!r}; choose from {sorted(PRESETS)}",
            file=sys.stderr,
        )
        return 2
    path = make_tiny(args.dir, preset, seed=args.seed)
    print(f"wrote tiny checkpoint (preset {preset}) to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "make-tiny":
        return cmd_make_tiny(args)
    from server.serve import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
