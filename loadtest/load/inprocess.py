"""A Canvas server inside this process: uvicorn on a free port, in a background thread.

The benchmark harness uses it so that one process builds the checkpoint, serves it, drives it
and then runs the reference, strictly one after the other, with one torch thread setting.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerHandle:
    url: str  # http://127.0.0.1:PORT (no /v1)
    model_name: str
    state: Any  # server.app.ServerState: the engine and metrics, for tests and the harness


@contextlib.contextmanager
def serve_in_thread(
    model_dir: Path | None, flags: Sequence[str] = (), start_timeout_s: float = 120.0
) -> Iterator[ServerHandle]:
    """Serve `model_dir` (None: the built-in default model) with `canvas serve` flags (e.g.
    --max-num-seqs 64) until the block ends; the engine thread and uvicorn are stopped on exit,
    also after an error."""
    import uvicorn

    from server.app import create_app
    from server.cli.serve import add_serve_arguments
    from server.http import uvicorn_config
    from server.serve import build_state

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    model = ["--model", str(model_dir)] if model_dir is not None else []
    args = parser.parse_args([*model, "--port", "0", *flags])
    state, banner = build_state(args)
    for line in banner[:3]:  # the address lines name the requested port 0: skip them
        logger.info("%s", line.strip())
    server = uvicorn.Server(
        uvicorn_config(
            create_app(state),
            state.http,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    thread = threading.Thread(target=server.run, name="canvas-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not (server.started and server.servers):
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process Canvas server did not start")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield ServerHandle(f"http://127.0.0.1:{port}", state.model_name, state)
    finally:
        server.should_exit = True
        thread.join(30)
        if thread.is_alive():
            logger.warning("the in-process server did not stop within 30 s")
        state.engine.shutdown()  # idempotent: no step may run while Python exits
