"""A Canvas server in a process of its own, as a sidecar deployment runs it.

`make bench` times Canvas through such a server: its engine thread shares the interpreter lock
only with its own HTTP event loop, as in production, and not with the load generator's (which
runs in the benchmark's process, as a client of a sidecar runs in the app's). Measured on the
2-core VM (`bench-tiny`, AR at 16 concurrent): with the client in the server's process the
forward took ~1.5x its offline time and the engine's overhead was 15-17% of a step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.load.inprocess import ServerHandle

logger = logging.getLogger(__name__)
_ADDRESS = re.compile(r"http://127\.0\.0\.1:(\d+)/v1")


@contextlib.contextmanager
def serve_in_subprocess(
    model_dir: Path | None,
    flags: Sequence[str] = (),
    threads: str | None = None,
    start_timeout_s: float = 300.0,
) -> Iterator[ServerHandle]:
    """`canvas serve` on `model_dir` (None: the built-in default model) with `flags`, on a
    free port of 127.0.0.1, with `--threads threads` (a count or "auto"; None: the server's
    default, auto; this process's OMP_NUM_THREADS is not passed on), until the block ends; then
    stopped (SIGTERM, then SIGKILL after 30 s). `ServerHandle.state` is None."""
    with serve_in_subprocesses(model_dir, [flags], threads, start_timeout_s) as (handle,):
        yield handle


@contextlib.contextmanager
def serve_in_subprocesses(
    model_dir: Path | None,
    flag_sets: Sequence[Sequence[str]],
    threads: str | None = None,
    start_timeout_s: float = 300.0,
) -> Iterator[list[ServerHandle]]:
    """One server per set of flags (`serve_in_subprocess`), all started at once (each start
    imports torch and loads the model: seconds), then waited for in order."""
    model = ["--model", str(model_dir)] if model_dir is not None else []
    base = [sys.executable, "-m", "server.cli", "serve", *model, "--host", "127.0.0.1"]
    base += ["--port", "0", "--drain-seconds", "0"]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # `make bench` sets it for the reference's process
    if threads is not None:
        base += ["--threads", str(threads)]
    with contextlib.ExitStack() as stack:
        started: list[tuple[subprocess.Popen, Any]] = []  # type: ignore[type-arg]
        stack.callback(lambda: _stop([process for process, _ in started]))
        for flags in flag_sets:
            log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            process = subprocess.Popen(
                [*base, *flags], stdout=log, stderr=subprocess.STDOUT, env=env
            )
            started.append((process, log))
        handles = []
        for process, log in started:
            url = _wait_until_up(process, log, start_timeout_s)
            name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            handles.append(ServerHandle(url, name, None))
        yield handles


def _stop(processes: list[subprocess.Popen]) -> None:  # type: ignore[type-arg]
    """SIGTERM to every server at once (each drains for 0 s), then wait; SIGKILL after 30 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            logger.warning("the Canvas server did not stop within 30 s; killing it")
            process.kill()
            process.wait()


def _wait_until_up(process: subprocess.Popen, log, timeout_s: float) -> str:  # type: ignore[type-arg]
    """The server's base URL once /health answers 200 (its banner names the port taken)."""
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        if process.poll() is not None:
            raise RuntimeError(f"the Canvas server exited ({process.returncode}):\n{text[-3000:]}")
        if url is None and (found := _ADDRESS.search(text)):
            url = f"http://127.0.0.1:{found.group(1)}"
        if url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
        time.sleep(0.2)
    raise RuntimeError(f"the Canvas server did not start within {timeout_s:.0f} s")
