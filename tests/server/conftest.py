"""A live Canvas server (uvicorn on a random port, in a background thread) on a tiny checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest.inprocess import serve_in_thread
from server.app import ServerState


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
    """Start a server on `checkpoint` (None: the built-in default model); returns it and a stop
    function."""
    stack = contextlib.ExitStack()
    handle = stack.enter_context(serve_in_thread(Path(checkpoint) if checkpoint else None, flags))
    return LiveServer(handle.url, handle.state, handle.model_name), stack.close


@pytest.fixture(scope="session")
def live_server(tiny_checkpoint) -> Iterator[LiveServer]:
    server, stop = start_server(str(tiny_checkpoint("c16")), "--served-model-name", "tiny")
    yield server
    stop()


@pytest.fixture(scope="session")
def exact_server(tiny_checkpoint) -> Iterator[LiveServer]:
    """The same checkpoint served with --exact (reference-exact, batch-invariant numerics)."""
    server, stop = start_server(
        str(tiny_checkpoint("c16")), "--served-model-name", "tiny", "--exact"
    )
    yield server
    stop()
