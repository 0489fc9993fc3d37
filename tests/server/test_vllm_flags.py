"""vLLM's spellings of Canvas's flags, several served names and several API keys: what a
`vllm serve` command line and its clients expect to keep working."""

from __future__ import annotations

import argparse

import httpx
import pytest

from server.cli.config import ENGINE_FLAGS, build_config
from server.cli.serve import add_serve_arguments
from server.serve import StartupError, check_api_keys
from tests.server.conftest import make_fake_server, start_server


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


def prefix_caching(*flags: str) -> bool:
    config = build_config(serve_args(*flags), None, ENGINE_FLAGS)
    return config.engine.prefix_caching


def test_vllms_prefix_caching_switches_set_canvas_setting_and_the_last_one_wins():
    assert prefix_caching() is True
    assert prefix_caching("--no-prefix-caching") is False
    assert prefix_caching("--no-enable-prefix-caching") is False
    assert prefix_caching("--enable-prefix-caching") is True
    assert prefix_caching("--no-prefix-caching", "--enable-prefix-caching") is True
    assert prefix_caching("--enable-prefix-caching", "--no-enable-prefix-caching") is False


def test_shutdown_timeout_is_drain_seconds():
    assert serve_args().drain_seconds == 5.0
    assert serve_args("--shutdown-timeout", "30").drain_seconds == 30.0
    assert serve_args("--shutdown-timeout", "30", "--drain-seconds", "2").drain_seconds == 2.0


def test_served_model_name_takes_several_names():
    assert serve_args().served_model_name is None
    assert serve_args("--served-model-name", "a", "b", "c").served_model_name == ["a", "b", "c"]


def test_models_lists_every_served_name_and_any_of_them_is_served():
    server = make_fake_server(other_names=("alias", "third"))
    with server.client:
        ids = [card["id"] for card in server.client.get("/v1/models").json()["data"]]
        assert ids == ["fake", "alias", "third"]
        for name in ("fake", "alias"):
            for path, body in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                r = server.client.post(path, json={"model": name, **body})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name  # the name the request used, as vLLM answers
        r = server.client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404
        message = r.json()["error"]["message"]
        assert "'fake', 'alias', 'third'" in message and "'other'" in message
        ok = server.client.post("/tokenize", json={"model": "third", "prompt": "a"})
        assert ok.status_code == 200


def test_every_key_is_accepted_and_any_other_is_a_401():
    server = make_fake_server(api_keys=("k3y-one", "k3y-two"))
    with server.client:
        for key in ("k3y-one", "k3y-two"):
            r = server.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        for header in ("Bearer k3y-three", "Bearer k3y-one k3y-two", "Bearer ", "k3y-one"):
            assert (
                server.client.get("/v1/models", headers={"Authorization": header}).status_code
                == 401
            )
        assert server.client.get("/v1/models").status_code == 401


def test_api_key_takes_several_keys_and_replaces_the_environments(monkeypatch):
    monkeypatch.delenv("CANVAS_API_KEY", raising=False)
    assert serve_args().api_key is None
    assert serve_args("--api-key", "a", "b", "--api-key", "c").api_key == ["a", "b", "c"]
    monkeypatch.setenv("CANVAS_API_KEY", "env-key")
    assert serve_args().api_key == ["env-key"]
    assert serve_args("--api-key", "a").api_key == ["a"]  # the flag overrides, as before
    assert check_api_keys(["a", "b"]) == ("a", "b") and check_api_keys(None) == ()
    for keys in (["a", ""], ["a", "b c"]):
        with pytest.raises(StartupError, match="--api-key / CANVAS_API_KEY") as error:
            check_api_keys(keys)
        assert "b c" not in str(error.value)


def test_serve_builds_the_names_and_keys_from_vllms_flags(tiny_checkpoint):
    server, stop = start_server(
        str(tiny_checkpoint("c16")),
        "--served-model-name",
        "tiny",
        "second",
        "--api-key",
        "k1",
        "k2",
        "--no-enable-prefix-caching",
        "--shutdown-timeout",
        "1",
    )
    try:
        assert server.state.served_names == ("tiny", "second")
        assert server.state.api_keys == ("k1", "k2")
        assert not server.state.engine.limits.prefix_caching
        for key in ("k1", "k2"):
            headers = {"Authorization": f"Bearer {key}"}
            r = httpx.get(f"{server.v1}/models", headers=headers)
            assert [card["id"] for card in r.json()["data"]] == ["tiny", "second"]
            body = {"model": "second", "prompt": "hi", "max_tokens": 2}
            r = httpx.post(f"{server.v1}/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == "second"
        wrong = {"Authorization": "Bearer k3"}
        assert httpx.get(f"{server.v1}/models", headers=wrong).status_code == 401
    finally:
        stop()
