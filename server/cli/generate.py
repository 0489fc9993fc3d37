"""`canvas generate`: one prompt through the offline engine (`LLM`), with its stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.params import MODE_NAMES
from server.cli.config import CHECKPOINT_FLAGS, add_flags, build_config


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers, got {text!r}"
        ) from None


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--model", required=True, help="checkpoint directory, or hub id org/name[@revision]"
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 2,15,9")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP, GIF) shown before --prompt in a chat turn "
        "(implies --chat; repeat for several)",
    )
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--mode", choices=MODE_NAMES, default=None, help="default: the checkpoint's")
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="diffusion: scales the t_min..t_max schedule (1 = the checkpoint's); AR and hybrid: "
        "sampling temperature (0 = greedy)",
    )
    gen.add_argument("--max-denoising-steps", type=int, default=None)
    add_flags(gen, CHECKPOINT_FLAGS)
    gen.add_argument("--json", action="store_true", help="print one JSON object")


def chat_prompt(
    model_dir: str | Path, tokenizer: Any, text: str, image_files: dict[str, bytes]
) -> tuple[list[int], list[Any]]:
    """A user turn of the images (file name → bytes), then `text`, through the chat template,
    with its images (decoded and preprocessed as the server does); ParamError naming the
    image."""
    from engine.inputs.images import ImageProcessor, expand_image_tokens

    if not image_files:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}]), []
    processor = ImageProcessor(model_dir)
    images = [processor.prepare(data, f"--image {name}") for name, data in image_files.items()]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    return expand_image_tokens(ids, images, processor.vision, "image"), images


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, DecodeMode, ParamError, SamplingParams
    from engine.checkpoints.hub import locate
    from engine.model import CheckpointError

    try:
        image_files = {path: Path(path).read_bytes() for path in args.image}  # before the model
        model_dir, _ = locate(args.model, args.download_dir)  # a hub id: its snapshot
        llm = LLM.from_config(build_config(args, model_dir, CHECKPOINT_FLAGS))
        params = SamplingParams(
            max_tokens=args.max_tokens,
            seed=args.seed,
            mode=DecodeMode(args.mode) if args.mode else None,
            temperature=args.temperature,
            max_denoising_steps=args.max_denoising_steps,
        )
        images: list[Any] = []
        if args.prompt_ids is not None:
            prompt: str | list[int] = args.prompt_ids
            if args.image:
                raise ParamError("image", "--image needs --prompt (a chat turn), not --prompt-ids")
        elif args.chat or args.image:
            if llm.tokenizer is None:
                raise ParamError("prompt", "this checkpoint has no tokenizer")
            prompt, images = chat_prompt(model_dir, llm.tokenizer, args.prompt, image_files)
        else:
            prompt = args.prompt
        (out,) = llm.generate(prompt, params, images=[images])
    except (CheckpointError, ParamError, ValueError, OSError) as exc:
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
