"""Servers for the tests: the app over a fake engine (fast, no torch, no model), and a live
Canvas server (uvicorn on a random port, in a background thread) on a tiny checkpoint."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from loadtest.load.inprocess import serve_in_thread
from server.app import ServerState, create_app
from tests.server.fake_engine import DEFAULTS, ByteTokenizer, FakeEngine


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
    """Without prefix caching: its tests compare requests that repeat a prompt and a seed, and
    with caching the repeat would run over a cached prompt, whose last bits differ from a
    computed one's (fast numerics; a canvas can turn that into other tokens)."""
    server, stop = start_server(
        str(tiny_checkpoint("c16")), "--served-model-name", "tiny", "--no-prefix-caching"
    )
    yield server
    stop()


@pytest.fixture(scope="session")
def cached_server(tiny_checkpoint) -> Iterator[LiveServer]:
    """The same checkpoint with prefix caching (the default)."""
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


@dataclass
class FakeServer:
    """The app over a FakeEngine, through Starlette's TestClient (lifespan included)."""

    client: TestClient
    engine: FakeEngine
    state: ServerState

    def post(self, path: str, **body: Any) -> httpx.Response:
        return self.client.post(f"/v1{path}", json={"model": "fake", **body})

    def sse(self, path: str, **body: Any) -> list[Any]:
        """The stream's data lines, parsed; "[DONE]" stays a string."""
        r = self.post(path, stream=True, **body)
        assert r.status_code == 200, r.text
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        return [line if line == "[DONE]" else json.loads(line) for line in lines]

    def metric(self, name: str, label: str = "") -> float:
        """The first sample of `name` whose labels contain `label` (e.g. 'reason="stop"')."""
        for line in self.client.get("/metrics").text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def make_fake_server(engine: FakeEngine | None = None, **state: Any) -> FakeServer:
    engine = engine or FakeEngine()
    server_state = ServerState(engine, ByteTokenizer(), DEFAULTS, "fake", **state)  # type: ignore[arg-type]
    return FakeServer(TestClient(create_app(server_state)), engine, server_state)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = make_fake_server()
    with server.client:
        yield server
