"""A live Canvas server (uvicorn on a random port, in a background thread) on a tiny checkpoint."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from server.app import ServerState, create_app
from server.serve import add_serve_arguments, build_state


@dataclass
class LiveServer:
    url: str
    state: ServerState
    model: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def start_server(checkpoint: str | None, *flags: str) -> tuple[LiveServer, Callable[[], None]]:
    """Start a server on `checkpoint` (None: the built-in default model)."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    model = ["--model", checkpoint] if checkpoint else []
    args = parser.parse_args([*model, "--port", "0", *flags])
    state, _ = build_state(args)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(state),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(15)
        state.engine.shutdown()  # idempotent; makes sure no step runs while Python exits

    return LiveServer(f"http://127.0.0.1:{port}", state, state.model_name), stop


@pytest.fixture(scope="session")
def live_server(tiny_checkpoint) -> Iterator[LiveServer]:
    server, stop = start_server(str(tiny_checkpoint("c16")), "--served-model-name", "tiny")
    yield server
    stop()
