"""`canvas serve`'s options for what clients send and what operators read: unknown fields
ignored on request, a chat template and its default variables from the command line, several
keys in CANVAS_API_KEY, JSON log lines."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import signal
from pathlib import Path

import httpx
import pytest

from engine.checkpoints.tiny import build_tokenizer
from engine.inputs.tokenizer import Tokenizer
from server.cli import main
from server.cli.serve import add_serve_arguments
from server.lenient import UnknownParams
from server.logs import JsonFormatter, use_log_format
from server.serve import StartupError, chat_template, uvicorn_logging
from tests.server.conftest import make_fake_server, start_server
from tests.server.process import serve_process

CHAT = {"messages": [{"role": "user", "content": "hi", "x_trace": "t1"}], "max_tokens": 2}
EXTRA = {"x_platform_tag": "abc", "best_of": 3, **CHAT}


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


def test_unknown_and_unsupported_fields_are_400s_by_default():
    server = make_fake_server()
    with server.client:
        r = server.post("/chat/completions", **EXTRA)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.x_trace"
        r = server.post("/completions", prompt="p", best_of=3)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_ignore_unknown_params_drops_them_and_logs_each_name_once(caplog):
    server = make_fake_server(unknown_params=UnknownParams())
    with server.client, caplog.at_level(logging.WARNING, "server.lenient"):
        for _ in range(2):
            r = server.post("/chat/completions", **EXTRA)
            assert r.status_code == 200, r.text
        r = server.post("/completions", prompt="p", max_tokens=2, x_platform_tag=1)
        assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records]
    assert len(logged) == 3, logged
    for name in ("'x_platform_tag'", "'best_of'", "'messages.0.x_trace'"):
        assert sum(name in line for line in logged) == 1
    # What was dropped never reached the engine; what was known did.
    assert server.engine.submitted[0].params.max_tokens == 2


def test_ignore_unknown_params_on_responses_drops_unknown_fields_only(caplog):
    server = make_fake_server(unknown_params=UnknownParams())
    body = {"model": "fake", "input": "hi", "max_output_tokens": 2}
    with server.client, caplog.at_level(logging.WARNING, "server.lenient"):
        r = server.post("/responses", **body, x_platform_tag="abc", seed=3)
        assert r.status_code == 200, r.text
        assert "'x_platform_tag'" in caplog.text
        # A field Canvas cannot honour is still refused: nothing is stored to continue from.
        r = server.post("/responses", **body, previous_response_id="resp_1")
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert server.engine.submitted[0].params.seed == 3  # a passthrough extra is kept


def test_ignore_unknown_params_still_refuses_a_bad_value_of_a_known_field():
    server = make_fake_server(unknown_params=UnknownParams())
    with server.client:
        r = server.post("/completions", prompt="p", max_tokens="many", x_tag=1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_canvas_api_key_takes_several_keys_separated_by_commas(monkeypatch):
    monkeypatch.setenv("CANVAS_API_KEY", "k-one,k-two")
    assert serve_args().api_key == ["k-one", "k-two"]
    monkeypatch.setenv("CANVAS_API_KEY", "k-one,,k-two")
    assert main(["serve", "--model", "/nonexistent", "--port", "0"]) == 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    tok = build_tokenizer(512)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    return Tokenizer(path)


THINKING = (
    "{{ 'T' if enable_thinking else 'F' }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
HI = [{"role": "user", "content": "hi"}]


def rendered(tokenizer: Tokenizer, **kwargs) -> str:
    return tokenizer.decode(tokenizer.apply_chat_template(HI, template_kwargs=kwargs))


def test_chat_template_from_a_file_or_inline_with_default_kwargs_a_request_overrides(
    tokenizer, tmp_path
):
    assert rendered(tokenizer) == "hi"
    path = tmp_path / "t.jinja"
    path.write_text(THINKING)
    chat_template(tokenizer, str(path), {"enable_thinking": False})
    assert rendered(tokenizer) == "F:hi"
    assert rendered(tokenizer, enable_thinking=True) == "T:hi"
    chat_template(tokenizer, "<{% for m in messages %}{{ m['content'] }}{% endfor %}>", None)
    assert rendered(tokenizer) == "<hi>"


@pytest.mark.parametrize(
    ("template", "defaults", "fragment"),
    [
        ("missing.jinja", None, "--chat-template missing.jinja: No such file"),
        ("{% if %}", None, "--chat-template is not valid Jinja"),
        ("{{ cycler.__init__.__globals__ }}", None, "--chat-template breaks the template sandbox"),
        (None, {"enable_thinking": "no"}, "--default-chat-template-kwargs: enable_thinking"),
    ],
)
def test_a_chat_template_that_cannot_be_used_is_a_start_up_error_naming_the_flag(
    tokenizer, template, defaults, fragment
):
    before = rendered(tokenizer)
    with pytest.raises(StartupError, match=fragment):
        chat_template(tokenizer, template, defaults)
    assert rendered(tokenizer) == before  # a template refused is not half taken


def test_default_chat_template_kwargs_must_be_a_json_object(capsys):
    for bad in ("{bad", "[1]"):
        with pytest.raises(SystemExit):
            serve_args("--default-chat-template-kwargs", bad)
        assert "argument --default-chat-template-kwargs" in capsys.readouterr().err
    assert serve_args(
        "--default-chat-template-kwargs", '{"a": 1}'
    ).default_chat_template_kwargs == {"a": 1}


def test_the_default_thinking_switch_reaches_the_template_unless_the_request_sets_it():
    server = make_fake_server()
    server.state.tokenizer.template_defaults = {"enable_thinking": False}  # type: ignore[union-attr]
    with server.client:
        for kwargs, line in ((None, b"think: off"), ({"enable_thinking": True}, b"think: on")):
            body = {**CHAT, "messages": HI, "chat_template_kwargs": kwargs}
            assert server.post("/chat/completions", **body).status_code == 200
            assert line in bytes(server.engine.submitted[-1].prompt_ids)


def test_json_logs_are_one_object_per_line_with_the_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    routes = logging.getLogger("server.routes")
    routes.addHandler(handler)
    routes.setLevel(logging.INFO)
    server = make_fake_server()
    try:
        with server.client:
            headers = {"x-request-id": "req-42"}
            body = {"model": "fake", "prompt": "p", "max_tokens": 2}
            assert server.client.post("/v1/completions", json=body, headers=headers).is_success
    finally:
        routes.removeHandler(handler)
        routes.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines and all(set(e) >= {"time", "level", "logger", "message"} for e in lines)
    assert lines[0]["request_id"] == "req-42" and lines[0]["logger"] == "server.routes"
    assert "prompt tokens" in lines[0]["message"]


def test_log_format_json_formats_the_root_handlers_and_uvicorns_loggers_propagate():
    assert uvicorn_logging(serve_args()).get("log_config", "unset") == "unset"
    assert uvicorn_logging(serve_args("--log-format", "json"))["log_config"] is None
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        use_log_format("json")
        assert isinstance(handler.formatter, JsonFormatter)
    finally:
        root.removeHandler(handler)
    with pytest.raises(SystemExit):
        serve_args("--log-format", "xml")


def test_a_chat_template_flag_path_is_read_as_text(tokenizer, tmp_path: Path):
    """A value with no braces or line breaks is a path, never a template."""
    with pytest.raises(StartupError, match="No such file"):
        chat_template(tokenizer, str(tmp_path / "nothing-here"), None)
    (tmp_path / "latin1.jinja").write_bytes(b"\xe9{{ messages }}")
    with pytest.raises(StartupError, match="--chat-template .*latin1.jinja: not UTF-8 text"):
        chat_template(tokenizer, str(tmp_path / "latin1.jinja"), None)


def test_serve_wires_the_template_flags_and_lenient_bodies(tiny_checkpoint):
    """The one server start of this file (a few seconds on the tiny checkpoint): the flags
    reach the tokenizer and the edge through `build_state`."""
    template = (
        "{{ 'T' if enable_thinking else 'F' }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    server, stop = start_server(
        str(tiny_checkpoint("c16")),
        "--chat-template",
        template,
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--ignore-unknown-params",
        "--threads",
        "1",
    )
    try:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": HI})
        assert r.status_code == 200, r.text
        detok = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]})
        assert detok.json()["prompt"] == "F[hi]"
        body = {"model": server.model, "messages": HI, "max_tokens": 2, "x_unknown": 1}
        assert httpx.post(f"{server.v1}/chat/completions", json=body).status_code == 200
    finally:
        stop()


def test_a_served_process_with_json_logs_writes_only_json_lines(tiny_checkpoint):
    """A real process (a few seconds): uvicorn's own lines, the access line included, are
    JSON too, and a request's lines carry its id."""
    with serve_process(tiny_checkpoint("c16"), ["--log-format", "json"]) as server:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        headers = {"x-request-id": "json-log-7"}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200
        server.signal(signal.SIGTERM)
        server.wait(30)
    lines = server.output.splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    # Whatever else was written is no log line (a native library's note at exit, say).
    text_logs = [x for x in lines if re.match(r"\d{4}-\d\d-\d\d |(INFO|WARNING|ERROR):", x)]
    assert not text_logs, text_logs
    loggers = {e["logger"] for e in entries}
    assert {"canvas", "uvicorn.error", "uvicorn.access"} <= loggers, loggers
    assert any(e.get("request_id") == "json-log-7" for e in entries)
