"""What a platform moving from vLLM expects of the HTTP front end, over the fake engine: /ping
and /load, CORS from the --allowed-* flags, uvicorn's log switches, and a body limit that lets
through every image the image limits allow."""

from __future__ import annotations

import argparse
import base64
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from engine.inputs.images import ImageLimits
from server.app import create_app
from server.cli.serve import add_serve_arguments
from server.http import uvicorn_config
from server.serve import StartupError, cors_policy, http_limits, uvicorn_logging
from server.state import TEXT_BODY_BYTES, ServerState
from tests.server.conftest import make_fake_server
from tests.server.fake_engine import DEFAULTS, ByteTokenizer, FakeEngine

ORIGIN = "https://app.example"


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


def test_ping_is_an_empty_200_when_ready_and_503_when_not(fake):
    for method in ("GET", "POST"):
        r = fake.client.request(method, "/ping")
        assert (r.status_code, r.content) == (200, b"")
    fake.state.draining = True
    assert fake.client.get("/ping").status_code == 503
    fake.state.draining = False
    fake.engine.alive = False  # the step loop is gone
    assert fake.client.get("/ping").status_code == 503


def test_ping_is_503_before_the_server_started():
    server = make_fake_server()  # the lifespan has not run: not ready
    assert server.client.get("/ping").status_code == 503
    with server.client:
        assert server.client.get("/ping").status_code == 200


def test_ping_and_load_need_no_api_key():
    server = make_fake_server(api_keys=("k3y",))
    with server.client:
        assert server.client.get("/ping").status_code == 200
        assert server.client.get("/load").status_code == 200
        assert server.client.get("/v1/models").status_code == 401


def test_load_counts_the_requests_in_flight(fake):
    assert fake.client.get("/load").json() == {"server_load": 0}
    fake.engine.delay = 0.05  # each canvas takes a while: the request stays in flight
    loads: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            load = fake.client.get("/load").json()["server_load"]
            if load:
                loads.append(load)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    r = fake.post("/completions", prompt="abc", max_tokens=16, n=2)
    watcher.join()
    assert r.status_code == 200, r.text
    assert loads == [2]  # two choices: two engine requests
    assert fake.client.get("/load").json() == {"server_load": 0}


def test_load_counts_a_request_admitted_before_its_engine_generator_runs(fake):
    ticket = fake.state.admission.admit(3, 0)
    assert ticket is not None
    assert fake.client.get("/load").json() == {"server_load": 3}
    ticket.release()
    assert fake.client.get("/load").json() == {"server_load": 0}


def preflight(client, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {
        "origin": origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    return client.options(path, headers=headers)


def test_cors_preflight_answers_an_allowed_origin_even_with_an_api_key():
    args = serve_args("--allowed-origins", f'["{ORIGIN}"]')
    server = make_fake_server(api_keys=("k3y",), cors=cors_policy(args))
    with server.client:
        r = preflight(server.client, ORIGIN)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        keyed = {"origin": ORIGIN, "authorization": "Bearer k3y"}
        r = server.client.post(
            "/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2}, headers=keyed
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in r.headers["access-control-expose-headers"]


def test_cors_refuses_a_preflight_from_an_origin_not_listed():
    args = serve_args("--allowed-origins", f'["{ORIGIN}"]')
    server = make_fake_server(cors=cors_policy(args))
    with server.client:
        r = preflight(server.client, "https://evil.example")
        assert r.status_code == 400
        assert "access-control-allow-origin" not in r.headers
        r = server.client.get("/v1/models", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_cors_is_off_without_allowed_origins(fake):
    assert cors_policy(serve_args()) is None
    r = preflight(fake.client, ORIGIN)
    assert "access-control-allow-origin" not in r.headers
    r = fake.client.get("/v1/models", headers={"origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_cors_any_origin_as_vllm_defaults():
    server = make_fake_server(cors=cors_policy(serve_args("--allowed-origins", '["*"]')))
    with server.client:
        assert preflight(server.client, ORIGIN).headers["access-control-allow-origin"] == "*"


def test_cors_flags_refuse_bad_json_and_credentials_for_any_origin(capsys):
    with pytest.raises(SystemExit):
        serve_args("--allowed-origins", "https://app.example")
    assert "is not a JSON list of strings" in capsys.readouterr().err
    args = serve_args("--allowed-origins", '["*"]', "--allowed-credentials")
    with pytest.raises(ValueError, match="--allowed-credentials"):
        cors_policy(args)


def access_lines(capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    """The access log lines (uvicorn's own handler writes them to stdout) of one GET
    /v1/models to uvicorn configured by `flags`."""
    state = ServerState(FakeEngine(), ByteTokenizer(), DEFAULTS, "fake")  # type: ignore[arg-type]
    options = uvicorn_logging(serve_args(*flags))
    capsys.readouterr()
    config = uvicorn_config(create_app(state), state.http, host="127.0.0.1", port=0, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not (server.started and server.servers):
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
    return [line for line in capsys.readouterr().out.splitlines() if "/v1/models" in line]


def test_the_access_log_has_a_line_per_request_unless_disabled(capsys):
    assert len(access_lines(capsys)) == 1
    assert access_lines(capsys, "--disable-uvicorn-access-log") == []
    assert access_lines(capsys, "--uvicorn-log-level", "warning") == []  # access lines: INFO


def test_uvicorn_log_level_sets_uvicorns_loggers():
    options = uvicorn_logging(serve_args("--uvicorn-log-level", "error"))
    uvicorn.Config(app=None, **options)  # type: ignore[arg-type]
    assert logging.getLogger("uvicorn.error").level == logging.ERROR
    uvicorn.Config(app=None, **uvicorn_logging(serve_args()))  # type: ignore[arg-type]
    assert logging.getLogger("uvicorn.error").level == logging.INFO


def image_chat(num_bytes: int) -> dict:
    image = base64.b64encode(b"\0" * num_bytes).decode()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
    return {"model": "fake", "messages": [{"role": "user", "content": [part]}]}


def test_the_default_body_limit_lets_every_image_the_image_limits_allow_through():
    args = serve_args()
    images = ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request)
    limits = http_limits(args.max_request_bytes, images)
    assert (
        limits.max_body_bytes
        >= TEXT_BODY_BYTES + images.max_images * images.max_image_bytes * 4 / 3
    )
    assert http_limits(None, None).max_body_bytes == TEXT_BODY_BYTES  # no images taken
    assert http_limits(12345, images).max_body_bytes == 12345
    with pytest.raises(StartupError, match="--max-request-bytes"):
        http_limits(0, images)
    server = make_fake_server(http=limits)
    with server.client:
        r = server.client.post("/v1/chat/completions", json=image_chat(5_000_000))
        assert r.status_code == 400, r.text  # past the edge: this model takes no images
        assert "image input is not supported" in r.json()["error"]["message"]
        over = image_chat(limits.max_body_bytes // 4 * 3 + 3)
        r = server.client.post("/v1/chat/completions", json=over)
        assert r.status_code == 413, r.text


def test_an_image_body_past_an_explicit_limit_is_413():
    server = make_fake_server(http=http_limits(*(4 << 20, ImageLimits())))
    with server.client:
        r = server.client.post("/v1/chat/completions", json=image_chat(5_000_000))
        assert r.status_code == 413
