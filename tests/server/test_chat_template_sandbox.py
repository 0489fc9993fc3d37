"""Chat templates render in a sandbox: a template that reaches for Python internals fails
cleanly, at start-up when any conversation triggers it, else with a 400 for the conversations
that do, and never runs what it reached for."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.checkpoints.tiny import build_tokenizer
from engine.inputs.tokenizer import Tokenizer
from server.app import ServerState, create_app
from server.cli import main
from tests.server.fake_engine import DEFAULTS, LIMITS, FakeEngine

TURNS = (
    "{%- for m in messages -%}<|turn>{{ m['role'] }}\\n{{ m['content'] }}<turn|>\\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|turn>model\\n{%- endif -%}"
)
# Each reaches for os.system; run unsandboxed, it would create the file MARK.
ESCAPES = {
    "str-subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler-globals": "{{ cycler.__init__.__globals__.os.system('touch MARK') }}",
    "joiner-globals": "{{ joiner.__init__.__globals__['os'].system('touch MARK') }}",
    "namespace-globals": "{{ namespace.__init__.__globals__['os'].system('touch MARK') }}",
    "format-string": "{{ '{0.__class__.__init__.__globals__}'.format('') }}",
}


def tokenizer_dir(path: Path, template: str) -> Path:
    tokenizer = build_tokenizer(512)
    tokenizer.chat_template = template.replace("MARK", str(path / "MARK"))
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("escape", list(ESCAPES.values()), ids=list(ESCAPES))
def test_a_template_that_reaches_for_python_internals_fails_at_load_naming_it(tmp_path, escape):
    directory = tokenizer_dir(tmp_path, escape + TURNS)
    with pytest.raises(ValueError, match="breaks the template sandbox's rules") as caught:
        Tokenizer(directory)
    assert f"the chat template of {directory}" in str(caught.value)
    assert not (tmp_path / "MARK").exists()


def test_a_template_that_is_not_jinja_fails_at_load_naming_it(tmp_path):
    directory = tokenizer_dir(tmp_path, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match=f"the chat template of {directory} is not valid Jinja"):
        Tokenizer(directory)


def test_canvas_serve_refuses_to_start_with_a_template_that_escapes(
    tiny_checkpoint, tmp_path, capsys
):
    checkpoint = Path(shutil.copytree(tiny_checkpoint("c16"), tmp_path / "ckpt"))
    (checkpoint / "chat_template.jinja").write_text(ESCAPES["cycler-globals"] + TURNS)
    assert main(["serve", "--model", str(checkpoint), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"canvas serve: error: the chat template of {checkpoint} breaks" in err
    assert "Traceback" not in err


@pytest.fixture
def conditional(tmp_path) -> Iterator[tuple[TestClient, Path]]:
    """A server whose template reaches for os.system only when a message says 'boom'."""
    trap = (
        "{%- if messages[-1]['content'] == 'boom' -%}" + ESCAPES["cycler-globals"] + "{%- endif -%}"
    )
    tokenizer = Tokenizer(tokenizer_dir(tmp_path, trap + TURNS))  # loads: 'Hello' is harmless
    limits = replace(LIMITS, vocab_size=512)
    state = ServerState(FakeEngine(limits=limits), tokenizer, DEFAULTS, "fake")  # type: ignore[arg-type]
    with TestClient(create_app(state)) as client:
        yield client, tmp_path / "MARK"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_conversation_that_trips_the_sandbox_is_a_400_and_runs_nothing(conditional, path):
    client, mark = conditional
    body = {"model": "fake"}
    ok = client.post(path, json={**body, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    r = client.post(path, json={**body, "messages": [{"role": "user", "content": "boom"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "the chat template broke its sandbox's rules" in error["message"]
    assert error["param"] == "messages"
    assert not mark.exists()
