"""The HTTP edge against hostile or careless clients, over the fake engine: bodies counted as
they are read, head and body deadlines, header limits, tokenisation off the event loop, and
every failure a JSON envelope. The socket-level tests run a real uvicorn (no torch, no model)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from server.app import create_app
from server.http import uvicorn_config
from server.state import HttpLimits, ServerState
from tests.server.conftest import make_fake_server
from tests.server.fake_engine import DEFAULTS, ByteTokenizer, FakeEngine

LIMITS = HttpLimits(max_body_bytes=1000, header_timeout_s=0.5, body_timeout_s=0.5)


@contextlib.contextmanager
def uvicorn_on_fake(limits: HttpLimits = LIMITS) -> Iterator[tuple[str, int]]:
    """The app over a FakeEngine, served by uvicorn as `canvas serve` configures it."""
    state = ServerState(FakeEngine(), ByteTokenizer(), DEFAULTS, "fake", http=limits)  # type: ignore[arg-type]
    config = uvicorn_config(create_app(state), limits, host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def edge_server() -> Iterator[tuple[str, int]]:
    with uvicorn_on_fake() as address:
        yield address


def read_until_closed(sock: socket.socket, within_s: float) -> bytes:
    """What the server sends until it closes the connection; fails if it is still open after
    `within_s`."""
    sock.settimeout(within_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_chunked_body_over_the_limit_is_413_without_reading_it_all(edge_server):
    """A chunked body (no Content-Length) is refused once 1000 bytes have arrived: the client
    sends 3 KB of a body it never finishes, and the 413 comes anyway (a server that waited
    for the whole body would never answer)."""
    host, port = edge_server
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    part = b'{"model": "fake", "prompt": "' + b"x" * 1000

    def chunk(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head.encode() + chunk(part) + chunk(b"x" * 1000) + chunk(b"x" * 1000))
        response = read_until_closed(sock, within_s=5)  # the terminating chunk is never sent
    status, _, rest = response.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"x-request-id" in rest.lower()
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert "exceeds the limit of 1000 bytes" in body["error"]["message"]


def test_a_body_shorter_than_its_content_length_is_408_within_the_timeout(edge_server):
    host, port = edge_server
    start = time.monotonic()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "fake"'
        )
        reply = read_until_closed(sock, within_s=3)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive within 0.5 s" in reply
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    "head", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["idle", "slow-head"]
)
def test_a_connection_without_a_whole_request_head_is_closed_within_the_timeout(edge_server, head):
    host, port = edge_server
    start = time.monotonic()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head)
        assert read_until_closed(sock, within_s=3) == b""
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "still-arriving"])
def test_an_oversized_request_head_is_refused(edge_server, whole):
    host, port = edge_server
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000
    with socket.create_connection((host, port)) as sock:
        sock.sendall(big + b"\r\n\r\n" if whole else big)
        reply = read_until_closed(sock, within_s=3)
    assert reply.startswith(b"HTTP/1.1 431" if whole else b"HTTP/1.1 400"), reply[:100]


def test_too_many_header_fields_are_431(fake):
    headers = {f"x-h{i}": "1" for i in range(120)}
    r = fake.client.get("/health", headers=headers)
    assert r.status_code == 431 and "More than 100 header fields" in r.json()["error"]["message"]


def test_an_unexpected_exception_is_a_500_envelope_naming_the_request_id():
    class BrokenTokenizer(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            raise TypeError("tokenizer bug")

    server = make_fake_server()
    server.state.tokenizer = BrokenTokenizer()  # type: ignore[assignment]
    with server.client:
        r = server.client.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "a"},
            headers={"x-request-id": "req-9"},
        )
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == "Internal error for request req-9"
    assert r.headers["x-request-id"] == "req-9"


def test_health_answers_within_a_second_while_a_big_prompt_is_tokenised():
    class SlowTokenizer(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            time.sleep(1.5)  # a 4 MiB prompt through a real tokenizer
            return super().encode(text)

    server = make_fake_server()
    server.state.tokenizer = SlowTokenizer()  # type: ignore[assignment]
    with server.client:
        slow = threading.Thread(target=server.post, args=("/completions",), kwargs={"prompt": "a"})
        slow.start()
        time.sleep(0.2)  # the slow request is being tokenised
        start = time.monotonic()
        assert server.client.get("/health").status_code == 200
        took = time.monotonic() - start
        slow.join()
    assert took < 1.0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", {"prompt": "ok \ud800"}, "prompt"),
        ("/completions", {"prompt": ["\udfff"]}, "prompt"),
        (
            "/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "user", "content": "\ud800"},
                ]
            },
            "messages.1.content",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(fake, path, body, param):
    escaped = json.dumps({"model": "fake", **body})  # "\ud800": valid JSON, invalid Unicode
    r = fake.client.post(
        f"/v1{path}", content=escaped, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert not fake.engine.submitted
