"""`canvas serve`'s serving jobs, each a named helper: bind the socket before the weights load,
build the server state (its engine through the one build path, `engine.build`), report
start-up errors in one line, freeze the loaded heap, and run uvicorn with a drain."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn

    from engine.build import BuildConfig
    from engine.inputs.images import ImageLimits
    from engine.inputs.tokenizer import Tokenizer
    from engine.process.messages import EngineInfo
    from engine.types import EngineClient
    from server.state import CorsPolicy, HttpLimits, ServerState

logger = logging.getLogger("canvas")

# A bearer key a client can send: HTTP header values are ASCII, and h11 strips the spaces and
# line breaks around them (a Secret file's trailing newline would make the key unmatchable).
API_KEY = re.compile(r"[\x21-\x7e]+")
# After the drain: how long the requests it ended get to send their last chunks before the
# connections still open are dropped.
FORCE_EXIT_GRACE_SECONDS = 1.0
# `canvas serve`'s exit status when the engine failed for good (a CUDA error the GPU context
# does not survive): a restart is the only way back.
EXIT_ENGINE_FAILED = 3


class StartupError(Exception):
    """`canvas serve` could not start; the message is one line naming the flag or path at
    fault."""


def check_api_keys(keys: list[str] | None) -> tuple[str, ...]:
    """The bearer keys /v1 accepts; () (auth off) only when no key is given at all. An empty
    key, or one no client can send, is refused rather than turning auth off or locking
    clients out. The message never quotes a key."""
    for key in keys or ():
        if not key:
            raise StartupError(
                "--api-key / CANVAS_API_KEY is set but empty (or lists an empty key): give a "
                "key, or unset it to serve without auth"
            )
        if API_KEY.fullmatch(key) is None:
            raise StartupError(
                "--api-key / CANVAS_API_KEY must be printable ASCII without spaces or line "
                "breaks (clients send it in an HTTP header; check for a trailing newline in "
                "the Secret)"
            )
    return tuple(keys or ())


def chat_template(
    tokenizer: Tokenizer, template: str | None, defaults: dict[str, Any] | None
) -> None:
    """Give `tokenizer` the chat template of `--chat-template` (a file, or the template
    itself when the value has braces or a line break and names no file, as vLLM reads it) and
    the template variables of `--default-chat-template-kwargs`; StartupError naming the flag
    for a file that cannot be read, a template that does not compile or breaks the sandbox,
    or an `enable_thinking` that is not a boolean."""
    defaults = defaults or {}
    if not isinstance(defaults.get("enable_thinking", False), bool):
        raise StartupError("--default-chat-template-kwargs: enable_thinking must be a boolean")
    if template is not None:
        path = Path(template)
        try:
            text = path.read_text()
        except OSError as exc:
            if not any(c in template for c in "{}\n"):
                raise StartupError(f"--chat-template {template}: {exc.strerror}") from None
            text = template
        except UnicodeDecodeError:
            raise StartupError(f"--chat-template {template}: not UTF-8 text") from None
        try:
            tokenizer.use_chat_template(text, "--chat-template")
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    tokenizer.template_defaults = defaults


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


def build_state(
    args: argparse.Namespace, own_threads: int | None = None
) -> tuple[ServerState, list[str]]:
    """The server state of `canvas serve`'s `args` and its banner: the engine built by the
    one build path (`engine.build`) from the configuration the flags describe. `own_threads`:
    torch's thread count when the caller confined parallel regions to the step loop (`serve`;
    `engine.cpu_threads.choose_threads`)."""
    from server.cli.config import CHECKPOINT_FLAGS, ENGINE_FLAGS, build_config, with_threads
    from server.lenient import UnknownParams
    from server.media import build_media
    from server.state import ServerState

    api_keys = check_api_keys(args.api_key)
    config = build_config(args, args.model or None, (*CHECKPOINT_FLAGS, *ENGINE_FLAGS))
    config = with_threads(config, args.threads, own_threads)  # before the weights load
    client, info, tokenizer = build_engine_client(config, args.log_format, own_threads)
    name, *other_names = args.served_model_name or [info.name]
    state = ServerState(client, tokenizer, info.defaults, name, tuple(other_names))
    state.api_keys = api_keys
    state.reasoning_field = args.reasoning_field
    if tokenizer is not None:
        chat_template(tokenizer, args.chat_template, args.default_chat_template_kwargs)
    elif args.chat_template or args.default_chat_template_kwargs:
        flag = "--chat-template" if args.chat_template else "--default-chat-template-kwargs"
        raise StartupError(f"{flag}: this checkpoint has no tokenizer, so it serves no chat")
    state.unknown_params = UnknownParams() if args.ignore_unknown_params else None
    state.media = build_media(args, info.model_dir, info.vision)
    images = state.media.policy.limits if state.media is not None else None
    state.http = http_limits(args.max_request_bytes, images)
    state.cors = cors_policy(args)
    return state, banner(args, state, info)


def build_engine_client(
    config: BuildConfig, log_format: str, own_threads: int | None
) -> tuple[EngineClient, EngineInfo, Tokenizer | None]:
    """The engine of `config` as the server sees it, what the server needs to know of it and
    the checkpoint's tokenizer: built here (`engine.async_engine.AsyncEngine`), or in a
    process of its own (`--engine-process`: `engine.process.client.RemoteEngine`), which then
    logs as this one does and, when this one confined torch to the step loop (`own_threads`
    set), confines its own main thread too before its weights load."""
    from engine.async_engine import AsyncEngine
    from engine.build import build
    from engine.process.client import RemoteEngine
    from engine.process.core import EngineSpec, engine_info

    if config.engine.process:
        if config.checkpoint.tensor_parallel_size > 1:
            raise StartupError("--engine-process is not run with --tensor-parallel-size > 1 yet")
        setup = functools.partial(engine_process_setup, log_format, own_threads is not None)
        remote = RemoteEngine(EngineSpec(config, setup=setup))
        return remote, remote.info, remote.tokenizer
    checkpoint, engine = build(config)
    client = AsyncEngine(engine)
    if checkpoint.ranks is not None:  # a rank that exits ends the engine (/health 503, exit)
        checkpoint.ranks.watch(client.fail)
        client.on_shutdown.append(checkpoint.ranks.stop)
    return client, engine_info(checkpoint, engine), checkpoint.tokenizer


def engine_process_setup(log_format: str, confined: bool) -> None:
    """The engine process's first step (`engine.process.core.EngineSpec.setup`): log lines as
    the serving process's; `confined`: torch on one thread in its main thread (the step loop
    sets its own count: `engine.cpu_threads.confine_to_steps`)."""
    from engine.cpu_threads import one_thread
    from server.logs import TEXT_LINE, use_log_format

    logging.basicConfig(level=logging.INFO, format=TEXT_LINE)
    use_log_format(log_format)
    if confined:
        one_thread()


def http_limits(max_request_bytes: int | None, images: ImageLimits | None) -> HttpLimits:
    """The HTTP limits of `--max-request-bytes` (None: derived from the image limits of a
    server that takes images, `images`; `server.state.request_body_limit`)."""
    from server.state import HttpLimits, request_body_limit

    if max_request_bytes is None:
        return HttpLimits(max_body_bytes=request_body_limit(images))
    if max_request_bytes < 1:
        raise StartupError("--max-request-bytes must be >= 1")
    return HttpLimits(max_body_bytes=max_request_bytes)


def cors_policy(args: argparse.Namespace) -> CorsPolicy | None:
    """The CORS policy of the --allowed-* flags; None (no CORS) without --allowed-origins."""
    from server.state import CorsPolicy

    if not args.allowed_origins:
        return None
    return CorsPolicy(
        tuple(args.allowed_origins),
        tuple(args.allowed_methods),
        tuple(args.allowed_headers),
        args.allowed_credentials,
    )


def uvicorn_logging(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's logging options as `--uvicorn-log-level`, `--disable-uvicorn-access-log` and
    `--log-format` set them."""
    options = {
        "log_level": args.uvicorn_log_level,
        "access_log": not args.disable_uvicorn_access_log,
    }
    if args.log_format == "json":
        options["log_config"] = None  # its loggers propagate to the root's JSON handler
    return options


def banner(args: argparse.Namespace, state: ServerState, info: EngineInfo) -> list[str]:
    """What the server logs once it is ready to listen: the model, the engine's settings and
    where to reach it."""
    split = "experts split whole" if args.enable_expert_parallel else "tensor parallel"
    ranks = (
        [f"  {args.tensor_parallel_size} ranks, {split}"] if args.tensor_parallel_size > 1 else []
    )
    return [
        f"Canvas serving {', '.join(map(repr, state.served_names))} from {info.model_dir}",
        f"  canvas length {info.canvas_length}, {info.num_layers} layers, "
        f"dtype {info.dtype}, device {args.device}, {info.kernels}",
        *ranks,
        *(["  engine in a process of its own"] if args.engine_process else []),
        f"  decoder adapter: {'attached' if info.adapter else 'none'}, "
        f"prefix caching {'on' if state.engine.limits.prefix_caching else 'off'}, "
        f"image input {'on' if state.media is not None else 'off'}",
        f"  max-num-seqs {info.limits.max_num_seqs}, max-queue {args.max_queue}, "
        f"auth {'on' if state.api_keys else 'off'}, "
        f"CORS {', '.join(state.cors.origins) if state.cors else 'off'}, "
        f"request bodies up to {state.http.max_body_bytes} bytes",
        f"  cpu threads {info.threads}",
        f"  http://{args.host}:{args.port}/v1  (docs: /docs, metrics: /metrics)",
    ]


def draining_server(
    state: ServerState, config: uvicorn.Config, drain_seconds: float, confined: bool = False
) -> uvicorn.Server:
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
            if state.engine.stats.failure and not self.should_exit:
                logger.critical("exiting (status %d) to be restarted", EXIT_ENGINE_FAILED)
                self.should_exit = True
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


def start(
    args: argparse.Namespace, own_threads: int | None = None
) -> tuple[socket.socket, ServerState, list[str]]:
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
    """Serve until a signal ends the drain (returns 0) or the engine fails for good (a CUDA
    error: returns EXIT_ENGINE_FAILED, so that Kubernetes restarts the pod); raises
    StartupError when it cannot start."""
    from engine.cpu_threads import confine_to_steps
    from engine.device.warmup import triton_cache_dir
    from engine.model.loader import resolve_device
    from server.app import create_app
    from server.http import uvicorn_config

    # On a CPU, before the model loads: only the step loop runs parallel regions. (On a GPU the
    # steps' CPU work is small, and a big checkpoint's load casts on the CPU: all threads.)
    cpu = resolve_device(args.device).startswith("cpu")
    own_threads = confine_to_steps() if cpu else None
    triton_cache = triton_cache_dir()  # before anything compiles
    sock, state, banner = start(args, own_threads)
    if state.engine.limits.kernels == "triton":
        banner.append(f"  Triton kernel cache {triton_cache}")
    for line in banner:
        logger.info(line)
    app = create_app(state)
    options = uvicorn_logging(args)
    config = uvicorn_config(app, state.http, host=args.host, port=args.port, **options)
    logger.info("  %d objects of the loaded server left out of garbage collection", freeze_heap())
    try:
        confined = own_threads is not None
        draining_server(state, config, args.drain_seconds, confined).run(sockets=[sock])
    finally:
        state.engine.shutdown()  # idempotent; a forced exit skips the app's own shutdown
    return EXIT_ENGINE_FAILED if state.engine.stats.failure else 0
