"""Secrets and hostile input: the API key is checked at start and never logged or echoed;
what a client sends cannot forge log lines or reach metric labels."""

from __future__ import annotations

import signal
import socket
import unicodedata
from pathlib import Path

import httpx
import pytest
import yaml

from server.cli import main
from tests.server.process import serve_process

KEY = "sekrit-key-5b1e"
WRONG_KEY = "wrong-key-77aa"
PROMPT = "PROMPT-MARKER-3f9c"
FORGED = "FORGED-LINE-INFO 200 OK"


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "is set but empty"),
        ("clé-sekrit", "must be printable ASCII"),
        ("sekrit\n", "must be printable ASCII"),
        ("two words", "must be printable ASCII"),
    ],
    ids=["empty", "non-ascii", "trailing-newline", "space"],
)
def test_an_unusable_api_key_is_a_start_up_error_that_does_not_quote_it(
    key, fragment, monkeypatch, capsys
):
    """An empty key used to turn auth off silently; a non-ASCII one could never match."""
    monkeypatch.setenv("CANVAS_API_KEY", key)  # the flag's default, read when parsing
    assert main(["serve", "--model", "/nonexistent", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"canvas serve: error: --api-key / CANVAS_API_KEY {fragment}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "sekrit" not in err and "config.json" not in err  # checked before the model loads


def test_the_kubernetes_api_key_secret_is_required():
    manifest = Path(__file__).parents[2] / "deploy" / "k8s" / "canvas.yaml"
    deployment = next(
        d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "Deployment"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "CANVAS_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"].get("optional", False) is False


def _raw_request(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head)
        return conn.recv(65536)


@pytest.fixture(scope="module")
def hostile_log(tiny_checkpoint) -> tuple[str, list[httpx.Response]]:
    """A keyed server's whole output after a round of hostile requests, and the responses."""
    auth = {"authorization": f"Bearer {KEY}"}
    # A generous read timeout: the first request of a fresh process on a loaded 2-core machine
    # may take longer than httpx's default 5 s.
    server_cm = serve_process(tiny_checkpoint("c16"), env={"CANVAS_API_KEY": KEY})
    with server_cm as server, httpx.Client(timeout=60) as http:
        v1 = f"{server.url}/v1"
        body = {"prompt": PROMPT, "max_tokens": 2}
        responses = [
            http.post(f"{v1}/completions", json={**body, "model": f"x\n{FORGED}"}, headers=auth),
            http.post(f"{v1}/completions", json={**body, "model": "\x1b[2J"}, headers=auth),
            http.post(
                f"{v1}/completions",
                json={**body, "model": "tiny"},
                headers={"authorization": f"Bearer {WRONG_KEY}"},
            ),
            http.post(
                f"{v1}/completions",
                json={**body, "model": "tiny", "max_tokens": 10**9},
                headers=auth,
            ),
            http.get(f"{v1}/models?q=%0A{FORGED.replace(' ', '%20')}", headers=auth),
            http.post(f"{v1}/completions", json={**body, "model": "tiny"}, headers=auth),
        ]
        hostile_heads = [
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\xff\r\n"
            b"User-Agent: ua\xe9\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUser-Agent: ua\x1b[31m\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\rFORGED\r\n\r\n",
        ]
        statuses = [_raw_request(server.url, head)[:12] for head in hostile_heads]
        metrics = http.get(f"{server.url}/metrics").text
        server.signal(signal.SIGTERM)
        server.wait(15)
    assert statuses[0] == b"HTTP/1.1 401", statuses  # a non-ASCII key is refused, not a 500
    assert all(s.startswith(b"HTTP/1.1 4") for s in statuses), statuses
    return server.output + metrics, responses


def test_the_api_key_and_a_wrong_key_never_reach_responses_or_logs(hostile_log):
    output, responses = hostile_log
    assert [r.status_code for r in responses] == [404, 404, 401, 400, 200, 200]
    for text in [output, *(r.text for r in responses)]:
        assert KEY not in text and WRONG_KEY not in text


def test_client_input_cannot_forge_log_lines_or_reach_metric_labels(hostile_log):
    output, _ = hostile_log
    assert not any(line.startswith(FORGED) for line in output.splitlines())
    assert "\x1b" not in output and "\r" not in output
    assert PROMPT not in output  # prompts are neither logged nor used as labels
    assert 'model_name="tiny"' in output


def test_an_unknown_model_name_is_echoed_without_control_characters(hostile_log):
    _, responses = hostile_log
    for r in responses[:2]:
        message = r.json()["error"]["message"]
        assert not any(unicodedata.category(c) == "Cc" for c in message), message
