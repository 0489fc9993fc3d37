"""`canvas serve`: load a checkpoint, build the engine, run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from engine.default_model import default_model_dir, placeholder_model_dir

if TYPE_CHECKING:
    from engine.types import EngineClient

logger = logging.getLogger("canvas")

# A bearer key a client can send: HTTP header values are ASCII, and h11 strips the spaces and
# line breaks around them (a Secret file's trailing newline would make the key unmatchable).
API_KEY = re.compile(r"[\x21-\x7e]+")
# After the drain: how long the requests it ended get to send their last chunks before the
# connections still open are dropped.
FORCE_EXIT_GRACE_SECONDS = 1.0


class StartupError(Exception):
    """`canvas serve` could not start; the message is one line naming the flag or path at
    fault."""


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
    from engine.adapt.cli import add_adapter_argument

    add_adapter_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="name clients pass as `model` (default: the checkpoint directory's name)",
    )
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
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="weight and activation dtype"
    )
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
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=5.0,
        help="on SIGTERM/SIGINT, let running requests finish for up to this long (a second "
        "signal exits at once)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CANVAS_API_KEY"),
        help="require this bearer key on /v1 (default: $CANVAS_API_KEY, which keeps it out of "
        "the process list; unset: no auth; empty: an error)",
    )
    parser.add_argument("--debug", action="store_true", help="traceback of a start-up error")
    _add_engine_switches(parser)


def choose_threads(
    requested: str | None, own: int | None = None, exact: bool = False
) -> tuple[int, ...]:
    """The CPU thread counts the engine runs steps with (`EngineConfig.cpu_threads`):
    `--threads N` fixes N; `--threads auto`, the default unless OMP_NUM_THREADS is set (then
    torch's count, which follows it), measures every usable core but one against every core,
    per step size, and runs each step with the faster (`engine.cpu_threads`). Why measure: a
    sidecar's front end and co-located clients take cores from the model's OpenMP regions,
    which then stall; where a step is a few small operators a second thread costs more in
    hand-offs than it adds. `own`:
    torch's count before `confine_to_steps` set this thread's to one (None: ask torch); a
    confined server runs exact numerics, which are never measured, at that count, set by the
    step loop (a tuner that does not measure sets none, and the loop would inherit one)."""
    import torch

    from engine.cpu_threads import auto_choices

    if requested is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return (own or torch.get_num_threads(),)
        requested = "auto"
    if requested == "auto":
        choices = auto_choices()
        return (own,) if own is not None and exact and len(choices) > 1 else choices
    try:
        count = int(requested)
    except ValueError:
        count = 0
    if count < 1:
        raise StartupError(f"--threads must be 'auto' or a count of at least 1, got {requested!r}")
    return (count,)


def describe_threads(choices: tuple[int, ...], exact: bool = False) -> str:
    """The banner's words for `choices` (exact numerics are never measured: torch's count)."""
    if len(choices) == 1:
        return str(choices[0])
    if exact:
        import torch

        return f"{torch.get_num_threads()} (torch's own: exact numerics' bits depend on the count)"
    counts = " or ".join(map(str, choices))
    return f"{counts}, per step, whichever measures faster (--threads auto)"


def _add_engine_switches(parser: argparse.ArgumentParser) -> None:
    """The engine's on/off flags (their defaults: EngineConfig's) and the media limits."""
    from server.media import add_media_arguments

    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute every prompt (default: complete prefix pages are cached and reused; "
        "exact numerics never cache)",
    )
    check = "verify pages, sampler slots and request sets after every step"
    parser.add_argument("--check-invariants", action="store_true", help=check)
    parser.add_argument(
        "--threads",
        default=None,
        help="CPU threads for the model's operators: a count, or 'auto' (default, unless "
        "$OMP_NUM_THREADS is set): every usable core but one (left to the HTTP front end and "
        "clients on the same machine) and every core are measured per step size, and each "
        "step runs with the faster",
    )
    add_media_arguments(parser)


def check_api_key(key: str | None) -> str | None:
    """The bearer key /v1 requires; None (auth off) only when no key is given at all. An empty
    key, or one no client can send, is refused rather than turning auth off or locking every
    client out. The message never quotes the key."""
    if key is None:
        return None
    if not key:
        raise StartupError(
            "--api-key / CANVAS_API_KEY is set but empty: give a key, or unset it to serve "
            "without auth"
        )
    if API_KEY.fullmatch(key) is None:
        raise StartupError(
            "--api-key / CANVAS_API_KEY must be printable ASCII without spaces or line breaks "
            "(clients send it in an HTTP header; check for a trailing newline in the Secret)"
        )
    return key


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening), so a taken port fails before the
    weights load; port 0 takes a free one."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = info[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"--host {host}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartupError(f"--host {host} --port {port}: cannot listen ({exc.strerror})") from None
    return sock


def build_state(args: argparse.Namespace, own_threads: int | None = None):  # type: ignore[no-untyped-def]
    """The engine, model and server state of `args`. `own_threads`: torch's thread count when
    the caller confined parallel regions to the step loop (`serve`; `choose_threads`)."""
    from engine.async_engine import AsyncEngine
    from engine.engine import CHECK_INVARIANTS, Engine, EngineConfig
    from engine.llm import has_tokenizer
    from engine.model import load_model
    from engine.params import DecodingDefaults
    from engine.scheduler import SchedulerConfig
    from engine.tokenizer import Tokenizer
    from server.media import build_media
    from server.state import ServerState

    api_key = check_api_key(args.api_key)
    threads = choose_threads(args.threads, own_threads, args.exact)
    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        exact=args.exact,
        kernels=args.kernels,
        adapter=args.adapter,
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
        check_invariants=args.check_invariants or CHECK_INVARIANTS,
        prefix_caching=not args.no_prefix_caching,
        cpu_threads=threads,
    )
    engine = AsyncEngine(Engine(model, defaults, config, tokenizer))
    name = args.served_model_name or model_dir.name
    state = ServerState(engine, tokenizer, defaults, name, api_key=api_key)
    state.media = build_media(args, model_dir, model.vision is not None)
    banner = [
        f"Canvas serving {name!r} from {model_dir}",
        f"  canvas length {model.config.canvas_length}, {model.cfg.num_layers} layers, "
        f"dtype {next(model.parameters()).dtype}, device {args.device}, "
        f"{model.kernels.describe()}",
        f"  decoder adapter: {'attached' if model.adapter is not None else 'none'}, "
        f"prefix caching {'on' if engine.limits.prefix_caching else 'off'}, "
        f"image input {'on' if state.media is not None else 'off'}",
        f"  max-num-seqs {args.max_num_seqs}, max-queue {args.max_queue}, "
        f"auth {'on' if api_key else 'off'}",
        f"  cpu threads {describe_threads(threads, model.kernels.exact)}",
        f"  http://{args.host}:{args.port}/v1  (docs: /docs, metrics: /metrics)",
    ]
    return state, banner


def draining_server(state, config, drain_seconds: float, confined: bool = False):  # type: ignore[no-untyped-def]
    """A uvicorn server that drains before it exits. The first SIGTERM or SIGINT starts the
    drain: /ready turns 503 and new completions get 503 + Retry-After while the running
    requests go on, until none is left or `drain_seconds` have passed. A second signal ends
    the drain at once. Requests still running then end with a 503 error (a stream: the in-band
    error chunk, then [DONE]); connections still open FORCE_EXIT_GRACE_SECONDS later are
    dropped. The signal is not re-raised afterwards: the process exits 0, with no
    KeyboardInterrupt traceback. `confined` (`engine.cpu_threads.confine_to_steps`): the
    event loop's helper threads (tokenizing, images, grammars) run torch on one thread."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_deadline: float | None = None
        announced = False

        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            # A signal handler: it only sets flags, which on_tick and shutdown act on.
            if self.should_exit:
                self.force_exit = True  # stop waiting for connections
            elif state.draining or drain_seconds <= 0:
                self.should_exit = True
            else:
                state.draining = True
                self.drain_deadline = time.monotonic() + drain_seconds

        async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            if confined:
                from engine.cpu_threads import one_thread

                helpers = ThreadPoolExecutor(thread_name_prefix="canvas-io", initializer=one_thread)
                asyncio.get_running_loop().set_default_executor(helpers)
            await super().startup(sockets)

        async def on_tick(self, counter: int) -> bool:
            if state.draining and not self.should_exit:
                if self.drain_deadline is not None and not self.announced:
                    self.announced = True
                    logger.info("draining for up to %g s (signal again to exit now)", drain_seconds)
                deadline = self.drain_deadline
                late = deadline is not None and time.monotonic() >= deadline
                if late or state.engine.stats.num_inflight == 0:
                    self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            num_ended = end_requests(state.engine)
            if num_ended:
                logger.warning("ending %d requests still running at shutdown", num_ended)
            loop = asyncio.get_running_loop()
            force = loop.call_later(FORCE_EXIT_GRACE_SECONDS, setattr, self, "force_exit", True)
            try:
                await super().shutdown(sockets)
            finally:
                force.cancel()

    return DrainingServer(config)


def end_requests(engine: EngineClient) -> int:
    """End every engine request still in flight with a 503 (the client may retry elsewhere)
    and abort it, freeing its pages; returns how many. Runs on the event loop."""
    from server.errors import DRAINING_RETRY_AFTER, APIError

    error = APIError(
        503,
        "The server shut down before this request finished; retry it",
        code="server_shutdown",
        headers={"Retry-After": DRAINING_RETRY_AFTER},
    )
    return engine.fail_all_inflight(error)


def start(args: argparse.Namespace, own_threads: int | None = None):  # type: ignore[no-untyped-def]
    """Bind the socket, then build the server state: (socket, state, banner). Any failure is
    a StartupError of one line (with --debug: the original exception, traceback and all)."""
    sock = None
    try:
        sock = listen_socket(args.host, args.port)
        args.port = sock.getsockname()[1]  # --port 0: the banner names the port taken
        state, banner = build_state(args, own_threads)
    except Exception as exc:
        if sock is not None:
            sock.close()
        if args.debug or isinstance(exc, StartupError):
            raise
        raise StartupError(_one_line(exc)) from exc
    return sock, state, banner


def _one_line(exc: Exception) -> str:
    """A start-up failure in one line. Checkpoint, flag and file errors (ValueError, OSError)
    already name their path or flag; anything else also gets its type and the --debug hint."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ValueError | OSError):
        return text
    return f"{type(exc).__name__}: {text} (run with --debug for the traceback)"


def freeze_heap() -> int:
    """Move every object alive now (the model's modules, the imported libraries, the app) out
    of the garbage collector's reach; returns how many. A full collection walks every tracked
    object while holding the interpreter lock, so the step loop stops with it: in a loaded
    server (hundreds of thousands of objects) each stalls a step for a noticeable time. Frozen
    objects are never collected (what was garbage is collected first); later
    collections walk only what serving allocates."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(args: argparse.Namespace) -> int:
    """Serve until a signal ends the drain (returns 0); raises StartupError when it cannot
    start."""
    from engine.cpu_threads import confine_to_steps
    from engine.model.loader import resolve_device
    from server.app import create_app
    from server.http import uvicorn_config

    # On a CPU, before the model loads: only the step loop runs parallel regions. (On a GPU the
    # steps' CPU work is small, and a big checkpoint's load casts on the CPU: all threads.)
    cpu = resolve_device(args.device).startswith("cpu")
    own_threads = confine_to_steps() if cpu else None
    sock, state, banner = start(args, own_threads)
    for line in banner:
        logger.info(line)
    app = create_app(state)
    config = uvicorn_config(app, state.http, host=args.host, port=args.port, log_level="info")
    logger.info("  %d objects of the loaded server left out of garbage collection", freeze_heap())
    try:
        confined = own_threads is not None
        draining_server(state, config, args.drain_seconds, confined).run(sockets=[sock])
    finally:
        state.engine.shutdown()  # idempotent; a forced exit skips the app's own shutdown
    return 0
