"""`canvas serve` in a child process, for what only a real process shows: signals, exit codes,
and what it writes to its logs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTED = "Application startup complete"
ADDRESS = re.compile(r"http://127\.0\.0\.1:(\d+)/v1")


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str  # http://127.0.0.1:PORT (no /v1)
    lines: list[str] = field(default_factory=list)  # stdout and stderr, as written

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> tuple[int, float]:
        """(exit code, seconds it took to exit)."""
        start = time.monotonic()
        code = self.process.wait(timeout)
        return code, time.monotonic() - start


@contextlib.contextmanager
def serve_process(
    model: Path, flags: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[ServeProcess]:
    """`canvas serve --model MODEL --port 0 --served-model-name tiny FLAGS`, started and ready;
    killed on exit if still running."""
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", "0"]
    process = subprocess.Popen(
        [*argv, "--served-model-name", "tiny", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="backslashreplace",
        env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})},
    )
    assert process.stdout is not None
    lines: list[str] = []
    port = None
    try:
        for line in process.stdout:
            lines.append(line)
            if (match := ADDRESS.search(line)) is not None:
                port = match.group(1)
            if STARTED in line:
                break
        assert port is not None and STARTED in lines[-1], "".join(lines)
        reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        yield ServeProcess(process, f"http://127.0.0.1:{port}", lines)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@contextlib.contextmanager
def serve_processes(*specs: tuple[Path, Sequence[str]]) -> Iterator[list[ServeProcess]]:
    """One `serve_process(model, flags)` per spec, all started at once (a start is seconds of
    mostly one core's work and waiting, so starts overlap well on a small CPU); each is killed
    on exit if still running, the started ones too when another fails to start."""
    managers = [serve_process(model, flags) for model, flags in specs]
    with contextlib.ExitStack() as stack:
        servers, failures = [], []
        with ThreadPoolExecutor(len(specs)) as pool:
            starts = [pool.submit(manager.__enter__) for manager in managers]
            for manager, start in zip(managers, starts, strict=True):
                try:
                    servers.append(start.result())
                    stack.push(manager.__exit__)
                except Exception as failure:
                    failures.append(failure)
        if failures:
            raise failures[0]
        yield servers


def children(pid: int) -> set[int]:
    """The processes `pid` started that are still alive (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def followers(pids: set[int]) -> list[int]:
    """Those of `pids` that are spawned (a parallel model's followers, an engine process; not
    the resource tracker)."""
    return [p for p in pids if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def wait_until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def unhealthy_reason(url: str, timeout_s: float = 30.0) -> str:
    """The reason `url`/health gives once it turns 503 (within `timeout_s`)."""
    health: dict[str, str] = {}

    def unhealthy() -> bool:
        response = httpx.get(f"{url}/health", timeout=timeout_s)
        health.update(response.json())
        return response.status_code == 503

    wait_until(unhealthy, timeout_s)
    return health["reason"]


def kill_and_check(server: ServeProcess, child: int | None, reason: str) -> None:
    """Kill `child`, a process `server` spawned (`canvas serve` must then exit 3 with `reason`
    in its output), or with `child` None the server itself; then every process the server had
    started must exit (a child sees its pipe close)."""
    started = children(server.process.pid)
    if child is not None:
        os.kill(child, signal.SIGKILL)
        code, _ = server.wait(60)
        assert code == 3, server.output
        assert reason in server.output
    else:
        server.process.kill()
        server.wait(60)
    wait_until(lambda: not any(alive(c) for c in started), 30)


class StreamReader:
    """A long streaming completion read on a thread: its `data:` lines as they come."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 8000, "ignore_eos": True}
        self._thread = threading.Thread(
            target=self._read, args=(f"{url}/v1/completions", {**body, "stream": True}, headers)
        )
        self._thread.start()

    def _read(self, url: str, body: dict[str, object], headers: dict[str, str] | None) -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.lines.append(line)

    def wait_for_chunks(self, num_chunks: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.lines) < num_chunks:
            assert time.monotonic() < deadline and self._thread.is_alive(), self.lines
            time.sleep(0.02)

    def join(self, timeout: float = 10.0) -> list[str]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.lines
