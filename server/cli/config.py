"""The command line's configuration tree: every flag that describes a build is defined once
here, as a `Flag` naming its field of `engine.build.BuildConfig` (a dotted path), and takes
that field's default; `build_config` maps parsed arguments back onto the record. Choices come
from their constants (`kernels.BACKENDS`, `engine.model.loader.DTYPE_CHOICES`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from engine.build import BuildConfig, CheckpointConfig, adapter_choice
from engine.model.loader import DEVICE_HELP, DTYPE_CHOICES, resolve_device
from engine.model.quant import QUANTIZATION_CHOICES
from kernels import BACKENDS


@dataclass(frozen=True, slots=True)
class Flag:
    """`name` sets the field at `path` in `BuildConfig`, whose default it shows. A `switch`
    takes no value: given, it sets the field to `switch`; absent, the field keeps its
    default. `kind`: the value's parser (default: the field default's type)."""

    name: str
    path: str
    help: str
    kind: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    negations: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


# How the checkpoint is opened: every command that loads a model.
DTYPE = Flag("--dtype", "checkpoint.dtype", "weight and activation dtype", choices=DTYPE_CHOICES)
DEVICE = Flag("--device", "checkpoint.device", DEVICE_HELP, kind=resolve_device)
EXACT = Flag(
    "--exact",
    "checkpoint.exact",
    "reference-exact numerics: the transformers reference's tokens for a seed, batch "
    "invariant (slower); default: fast batched numerics",
    switch=True,
)
KERNELS = Flag(
    "--kernels",
    "checkpoint.kernels",
    "kernel backend (auto: the fastest this device has; Triton on CUDA)",
    choices=BACKENDS,
)
ADAPTER = Flag(
    "--adapter",
    "checkpoint.adapter",
    "decoder adapter for diffusion mode: a directory, auto (the checkpoint's own adapter/ if "
    "any; default) or none",
    kind=adapter_choice,
    metavar="DIR|auto|none",
)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (argparse names the flag when it is not one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


GENERATION_CONFIG = Flag(
    "--generation-config",
    "checkpoint.generation_config",
    "where the decoding defaults come from: auto (the checkpoint's generation_config.json), "
    "canvas (Canvas's own defaults, max_new_tokens 256 among them), vllm (Canvas's defaults "
    "and no max_new_tokens, so a request without max_tokens may use the rest of the context) "
    "or a directory holding a generation_config.json; canvas and vllm keep the checkpoint's "
    "EOS and pad ids and its default mode",
    kind=str,
    metavar="auto|canvas|vllm|DIR",
)
OVERRIDE_GENERATION_CONFIG = Flag(
    "--override-generation-config",
    "checkpoint.override_generation_config",
    "generation_config.json keys set over the loaded ones, a JSON object: "
    '\'{"max_new_tokens": 4096, "t_min": 0.3}\'',
    kind=json_object,
    metavar="JSON",
)
DOWNLOAD_DIR = Flag(
    "--download-dir",
    "checkpoint.download_dir",
    "where a hub id (--model org/name[@revision]) is downloaded and cached (default: "
    "huggingface_hub's cache, $HF_HUB_CACHE)",
    kind=Path,
    metavar="DIR",
)
QUANTIZATION = Flag(
    "--quantization",
    "checkpoint.quantization",
    "weight quantization: auto (as the checkpoint stores them; an FP8 checkpoint loads as FP8) "
    "or fp8 (quantize a bf16 checkpoint's projections and experts per output channel at load)",
    choices=QUANTIZATION_CHOICES,
)
CHECKPOINT_FLAGS = (
    *(DTYPE, DEVICE, EXACT, KERNELS, ADAPTER, QUANTIZATION),
    *(GENERATION_CONFIG, OVERRIDE_GENERATION_CONFIG, DOWNLOAD_DIR),
)

# The engine's own configuration: `canvas serve`.
ENGINE_FLAGS = (
    Flag(
        "--max-num-seqs",
        "engine.scheduler.max_num_seqs",
        "requests running at once, at most (the memory plan may run fewer)",
    ),
    Flag("--max-queue", "engine.scheduler.max_queue", "requests waiting before 429"),
    Flag("--max-num-batched-tokens", "engine.scheduler.max_num_batched_tokens", "tokens per step"),
    Flag(
        "--kv-cache-tokens",
        "engine.kv_cache_tokens",
        "full-attention KV positions (default: what the memory plan leaves; on a CPU at most "
        "131,072 or --max-model-len)",
        kind=int,
    ),
    Flag(
        "--gpu-memory-utilization",
        "engine.memory.gpu_memory_utilization",
        "share of the device's memory the engine may hold, weights included (on a CPU: of the "
        "RAM available at start); the KV cache, sampler and step are sized to fit",
    ),
    Flag(
        "--max-model-len",
        "engine.memory.max_model_len",
        "longest context (prompt plus completion) of a request (default: the model's "
        "max_position_embeddings); the memory plan runs as many requests of it as fit, up to "
        "--max-num-seqs",
        kind=int,
    ),
    Flag(
        "--no-prefix-caching",
        "engine.prefix_caching",
        "recompute every prompt (default: complete prefix pages are cached and reused; exact "
        "numerics never cache)",
        switch=False,
        aliases=("--no-enable-prefix-caching",),
        negations=("--enable-prefix-caching",),
    ),
    Flag(
        "--check-invariants",
        "engine.check_invariants",
        "verify pages, sampler slots and request sets after every step",
        switch=True,
    ),
    Flag(
        "--no-warmup",
        "engine.warmup",
        "report ready at once, without warming up: the first requests compile the kernels they "
        "use (default: where kernels compile at first use, Triton on a GPU, /ready turns 200 "
        "only once a step of every row kind at each step size has compiled them)",
        switch=False,
    ),
    Flag(
        "--tensor-parallel-size",
        "checkpoint.tensor_parallel_size",
        "ranks (GPUs; processes on a CPU) the model is split over: canvas serve starts the "
        "others itself (docs/parallelism.md)",
        aliases=("-tp",),
    ),
    Flag(
        "--enable-expert-parallel",
        "checkpoint.expert_parallel",
        "split the experts whole over the ranks instead of each expert's slice (with "
        "--tensor-parallel-size 2 or more)",
        switch=True,
    ),
    Flag(
        "--distributed-port",
        "checkpoint.distributed_port",
        "port on 127.0.0.1 the ranks form their world at (default 0: $MASTER_PORT, else a "
        "free one)",
    ),
    Flag(
        "--cuda-graphs",
        "engine.cuda_graphs",
        "replay the forward of steps whose rows are all canvases (or all AR tokens) as CUDA "
        "graphs, one per bucket of canvases (rows), captured at warm-up (up to 4 canvases with "
        "the LM head and the sampler, up to 4 AR rows with the head; "
        "the memory plan counts their pools; default off until a GPU run shows replay equal to "
        "eager; a CUDA device and the Triton kernels only)",
        switch=True,
    ),
    Flag(
        "--overlap",
        "engine.overlap",
        "run the next denoising step's forward while a thread of its own applies the last "
        "step, hands its outputs over (streaming, metrics) and plans the next; same tokens "
        "(default off; exact numerics never overlap)",
        switch=True,
    ),
    Flag(
        "--engine-process",
        "engine.process",
        "run the engine's step loop in a process of its own beside the HTTP front end, so the "
        "two never wait on one interpreter lock (default off: on a busy CPU it was no faster "
        "at 16 canvases)",
        switch=True,
    ),
)


class _Switch(argparse.Action):
    """A switch's spellings: each sets it (True), those in `negations` unset it (False), so
    the last one given wins."""

    def __init__(
        self, option_strings: list[str], dest: str, negations: tuple[str, ...], **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)
        self.negations = negations

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string not in self.negations)


def field_value(record: Any, path: str) -> Any:
    """The value at dotted `path` in nested dataclass `record`."""
    for name in path.split("."):
        record = getattr(record, name)
    return record


def with_field(record: Any, path: str, value: Any) -> Any:
    """`record` with the field at dotted `path` replaced (frozen dataclasses, rebuilt up the
    path)."""
    head, _, rest = path.partition(".")
    if rest:
        value = with_field(getattr(record, head), rest, value)
    return replace(record, **{head: value})


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], **defaults: Any) -> None:
    """Add `flags`, each defaulting to its field's default in `BuildConfig()` or to
    `defaults[flag.dest]` (a command whose own config record defaults otherwise)."""
    base = BuildConfig()
    for flag in flags:
        names = (flag.name, *flag.aliases)
        if flag.switch is not None:
            parser.add_argument(
                *names,
                *flag.negations,
                dest=flag.dest,
                action=_Switch,
                negations=flag.negations,
                help=flag.help,
            )
            continue
        default = defaults.get(flag.dest, field_value(base, flag.path))
        parser.add_argument(
            *names,
            type=flag.kind or type(default),
            default=default,
            choices=flag.choices,
            metavar=flag.metavar,
            help=flag.help,
        )


def build_config(
    args: argparse.Namespace, model: str | Path | None, flags: Sequence[Flag] = ()
) -> BuildConfig:
    """The build of `model` (a directory or a hub id, as given; None: the built-in default
    model) that the parsed `flags` of `args` describe; fields without a flag keep their
    defaults."""
    config = BuildConfig(CheckpointConfig(model_dir=model))
    for flag in flags:
        value = getattr(args, flag.dest)
        if flag.switch is None:
            config = with_field(config, flag.path, value)
        elif value:
            config = with_field(config, flag.path, flag.switch)
    return config


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """--threads: a request ("auto", a count, or unset) that the engine's thread policy turns
    into `EngineConfig.cpu_threads` (`with_threads`)."""
    parser.add_argument(
        "--threads",
        default=None,
        help="CPU threads for the model's operators: a count, or 'auto' (default, unless "
        "$OMP_NUM_THREADS is set): every usable core but one (left to the HTTP front end and "
        "clients on the same machine) and every core are measured per step size, and each "
        "step runs with the faster",
    )


def with_threads(config: BuildConfig, requested: str | None, own: int | None) -> BuildConfig:
    """`config` with the CPU thread counts the engine's policy chooses for `--threads
    requested` (`engine.cpu_threads.choose_threads`: ValueError naming the flag). `own`:
    torch's count before the server confined it to the step loop (None: not confined)."""
    from engine.cpu_threads import choose_threads

    threads = choose_threads(requested, own, config.checkpoint.exact)
    return with_field(config, "engine.cpu_threads", threads)


def field_defaults(cls: type) -> dict[str, Any]:
    """A config dataclass's field defaults, by field name."""
    assert is_dataclass(cls)
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Config dataclass `cls` built from the parsed arguments whose names are its fields."""
    assert is_dataclass(cls)
    given = vars(args)
    return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
