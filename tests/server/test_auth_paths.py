"""The API key on every spelling of a path: over a real uvicorn (which decodes the request
target as deployments see it), no path, `Host` or `X-Forwarded-*` header reaches a keyed route
without the key; the public routes stay public."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from server.app import create_app
from server.http import uvicorn_config
from tests.server.conftest import FakeServer, make_fake_server

KEY = "sekrit-5b1e"
BODIES = {
    "completions": b'{"model": "fake", "prompt": "a", "max_tokens": 2}',
    "chat": b'{"model": "fake", "messages": [{"role": "user", "content": "a"}]}',
    "tokenize": b'{"prompt": "a"}',
    "detokenize": b'{"tokens": [97]}',
    "models": b"",
    "reset": b"",
}
# Each spelling of a keyed route, and the body that route would accept.
KEYED_SPELLINGS = [
    ("/v1/completions", "completions"),
    ("//v1/completions", "completions"),
    ("/v1//completions", "completions"),
    ("/v1%2Fcompletions", "completions"),
    ("/v1%2fcompletions", "completions"),
    ("%2Fv1%2Fcompletions", "completions"),
    ("/v1/completions/", "completions"),
    ("/v1/completions%2F", "completions"),
    ("/./v1/completions", "completions"),
    ("/v1/./completions", "completions"),
    ("/v1/../v1/completions", "completions"),
    ("/health/../v1/completions", "completions"),
    ("/V1/completions", "completions"),
    ("/v1/Completions", "completions"),
    ("/v1/completions%00", "completions"),
    ("/v1/completions;x", "completions"),
    ("/v1/completions?x=/health", "completions"),
    ("/v1/chat/completions", "chat"),
    ("//v1/chat/completions", "chat"),
    ("/v1/chat%2Fcompletions", "chat"),
    ("/v1/chat/completions/", "chat"),
    ("/v1/models", "models"),
    ("/v1/models/", "models"),
    ("/v1%2Fmodels", "models"),
    ("/tokenize", "tokenize"),
    ("//tokenize", "tokenize"),
    ("/tokenize/", "tokenize"),
    ("/Tokenize", "tokenize"),
    ("/%74okenize", "tokenize"),
    ("/detokenize", "detokenize"),
    ("/detokenize/", "detokenize"),
    ("/reset_prefix_cache", "reset"),
    ("//reset_prefix_cache", "reset"),
    ("/reset_prefix_cache/", "reset"),
    ("/nothing", "models"),
]
HOSTILE_HEADERS = [
    {},
    {"host": "localhost"},
    {"host": "127.0.0.1:1/health"},
    {"x-forwarded-host": "internal", "x-forwarded-proto": "https", "x-forwarded-for": "127.0.0.1"},
    {"x-forwarded-prefix": "/health"},
    {"x-forwarded-prefix": "/v1"},
]


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[str, FakeServer]]:
    """A keyed server over the fake engine, behind a real uvicorn: (host:port, the server)."""
    server = make_fake_server(api_keys=(KEY,))
    config = uvicorn_config(
        create_app(server.state), server.state.http, host="127.0.0.1", port=0, log_level="error"
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (uv.started and uv.servers) and time.monotonic() < deadline:
        time.sleep(0.02)
    host, port = uv.servers[0].sockets[0].getsockname()[:2]
    yield f"{host}:{port}", server
    uv.should_exit = True
    thread.join(10)


def raw(address: str, method: str, target: str, headers: dict[str, str], body: bytes) -> int:
    """The status of one request sent byte for byte, the target exactly as given."""
    host, port = address.split(":")
    head = {"host": address, "content-type": "application/json", **headers}
    head["content-length"] = str(len(body))
    lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
    data = ("\r\n".join([*lines, "connection: close", "", ""])).encode() + body
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(data)
        reply = b""
        while b"\r\n" not in reply and (chunk := conn.recv(4096)):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def _method(kind: str) -> str:
    return "GET" if kind == "models" else "POST"


@pytest.mark.parametrize("headers", HOSTILE_HEADERS, ids=lambda h: ",".join(h) or "plain")
@pytest.mark.parametrize(("target", "kind"), KEYED_SPELLINGS, ids=[t for t, _ in KEYED_SPELLINGS])
def test_no_spelling_of_a_keyed_path_runs_without_the_key(keyed, target, kind, headers):
    address, server = keyed
    before = len(server.engine.submitted)
    status = raw(address, _method(kind), target, headers, BODIES[kind])
    assert status == 401, (target, headers, status)
    assert len(server.engine.submitted) == before  # the route never ran
    assert server.engine.prefix_cache_resets == 0


@pytest.mark.parametrize(("target", "kind"), KEYED_SPELLINGS, ids=[t for t, _ in KEYED_SPELLINGS])
def test_with_the_key_a_spelling_either_reaches_its_route_or_is_not_found(keyed, target, kind):
    address, _ = keyed
    auth = {"authorization": f"Bearer {KEY}"}
    status = raw(address, _method(kind), target, auth, BODIES[kind])
    assert status in (200, 307, 404, 405), (target, status)


@pytest.mark.parametrize("target", ["/health", "/ready", "/metrics", "/version", "/docs", "/"])
def test_the_operational_routes_and_the_page_stay_public(keyed, target):
    address, _ = keyed
    assert raw(address, "GET", target, {}, b"") == 200


@pytest.mark.parametrize("target", ["/health/", "//health", "/HEALTH", "/health%2F..%2Fv1"])
def test_a_misspelt_public_path_needs_the_key_too(keyed, target):
    address, _ = keyed
    assert raw(address, "GET", target, {}, b"") == 401
