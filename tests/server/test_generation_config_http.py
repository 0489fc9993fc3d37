"""`--generation-config` end to end: a chat without `max_tokens` is capped at the
checkpoint's `max_new_tokens` under `auto` (the default) and may use the rest of the context
under `vllm` (vLLM's switch), on a live server over a tiny checkpoint."""

from __future__ import annotations

import httpx

from engine.params import DecodingDefaults
from tests.server.conftest import start_server

# Few KV positions keep the uncapped answer short; two denoising steps keep it quick.
FLAGS = ("--kv-cache-tokens", "512", "--override-generation-config", '{"max_denoising_steps": 2}')
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "seed": 1,
    "ignore_eos": True,
}


def complete(*flags: str, checkpoint: str) -> tuple[dict, int]:
    """The usage of one chat without max_tokens (which ends for its length), and the budget
    the server's validator gives such a request."""
    server, stop = start_server(checkpoint, "--served-model-name", "tiny", *FLAGS, *flags)
    try:
        r = httpx.post(f"{server.v1}/chat/completions", json=BODY, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        room = server.state.validator.default_max_tokens(body["usage"]["prompt_tokens"])
        assert body["choices"][0]["finish_reason"] == "length"
        return body["usage"], room
    finally:
        stop()


def test_vllm_lifts_the_checkpoints_max_new_tokens_and_auto_keeps_it(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("c16"))
    cap = DecodingDefaults.from_checkpoint(checkpoint, ()).max_new_tokens
    assert cap == 256, "the tiny checkpoint's generation_config.json"
    usage, _ = complete(checkpoint=checkpoint)
    assert usage["completion_tokens"] == cap
    usage, room = complete("--generation-config", "vllm", checkpoint=checkpoint)
    assert usage["completion_tokens"] == room > cap
