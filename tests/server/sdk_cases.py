"""A server for client tests: the tiny checkpoint's tokenizer (its Gemma 4-format template
renders tools, thoughts and tool turns) over a fake engine that answers with recorded Gemma 4
outputs, reached by the official `openai` client or plain HTTP through Starlette's TestClient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient

from engine.inputs.tokenizer import Tokenizer
from server.app import create_app
from server.state import ServerState
from tests.server.fake_engine import DEFAULTS, LIMITS, FakeEngine

EOS = 1  # the tiny tokenizer's <eos>
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
ASK = {"role": "user", "content": "Weather in SF and Tokyo?"}


@dataclass
class SdkServer:
    client: TestClient
    engine: FakeEngine
    tokenizer: Tokenizer

    def answer(self, text: str) -> None:
        """What the fake model writes next (markup as the checkpoint writes it), then EOS."""
        ids = self.tokenizer.encode(text, add_special_tokens=False, markup=True)
        self.engine.answer = [*ids, EOS]

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key="-", max_retries=0, http_client=self.client
        )

    def post(self, path: str, **body: Any) -> tuple[int, Any]:
        r = self.client.post(f"/v1{path}", json={"model": "fake", **body})
        return r.status_code, r.json()

    def last_prompt(self) -> str:
        """The last request's prompt as the template wrote it, markup included."""
        return str(self.tokenizer.hf.decode(self.engine.submitted[-1].prompt_ids))


@contextlib.contextmanager
def sdk_server(checkpoint: Path, **state: Any) -> Iterator[SdkServer]:
    """The server over `checkpoint`'s tokenizer (`state`: more ServerState fields)."""
    tokenizer = Tokenizer(checkpoint)
    limits = replace(LIMITS, vocab_size=512, max_context_positions=4096, max_fit_positions=4096)
    engine = FakeEngine(limits=limits)
    defaults = replace(DEFAULTS, eos_token_ids=(EOS,), max_new_tokens=400)
    server_state = ServerState(engine, tokenizer, defaults, "fake", **state)
    with TestClient(create_app(server_state)) as client:
        yield SdkServer(client, engine, tokenizer)
