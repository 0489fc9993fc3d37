"""`canvas serve --engine-process` end to end over HTTP: the engine in a spawned process gives
the in-process engine's tokens (chat, completion, AR with logprobs, a JSON schema, an image),
streams them, aborts a request whose client went away, keeps the metrics the step listeners
feed, refuses a bad schema with a 400 before it is queued, and when the engine process dies or
loses its GPU context fails the server (/health 503 with the reason, 500s, exit 3); the engine
process exits when the serving process dies.

Each engine process is spawned (it imports torch and builds the engine): seconds per server on
a small CPU, so the module starts few servers and every wait has a timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.build import BuildConfig, CheckpointConfig
from engine.params import SamplingParams
from engine.process.client import RemoteEngine
from engine.process.core import EngineSpec
from engine.validation import RequestValidator
from loadtest.load.inprocess import ServerHandle, serve_in_thread
from server.cli import main
from tests.media import data_url, encode, noise_image
from tests.server.process import (
    ServeProcess,
    children,
    followers,
    kill_and_check,
    serve_processes,
    unhealthy_reason,
    wait_until,
)

COMMON = ("--device", "cpu", "--no-prefix-caching", "--kernels", "twins")
TIMEOUT = httpx.Timeout(120.0)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
BODIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("chat/completions", {"messages": [{"role": "user", "content": "hello"}], "seed": 3}),
    ("completions", {"prompt": "Once upon a time", "seed": 5}),
    ("completions", {"prompt": "2 + 2 =", "mode": "ar", "temperature": 0, "logprobs": 2}),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "a number"}],
            "seed": 7,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            },
        },
    ),
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("c16")


@pytest.fixture(scope="module")
def here(checkpoint: Path) -> Iterator[ServerHandle]:
    with serve_in_thread(checkpoint, COMMON) as server:
        yield server


@pytest.fixture(scope="module")
def there(checkpoint: Path) -> Iterator[ServerHandle]:
    with serve_in_thread(checkpoint, [*COMMON, "--engine-process"]) as server:
        assert isinstance(server.state.engine, RemoteEngine)
        yield server


def post(server: ServerHandle, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/{route}", json={"model": server.model_name, **body}, timeout=TIMEOUT
    )


def answer(response: httpx.Response) -> tuple[Any, Any]:
    """(choices without ids, usage) of a 200."""
    assert response.status_code == 200, response.text
    got = response.json()
    return got["choices"], got["usage"]


@pytest.mark.parametrize(("route", "body"), BODIES, ids=["chat", "completion", "ar", "schema"])
def test_the_engine_process_gives_the_in_process_engines_tokens(
    here: ServerHandle, there: ServerHandle, route: str, body: dict[str, Any]
) -> None:
    body = {"max_tokens": 16, "max_denoising_steps": 4, **body}
    assert answer(post(there, route, body)) == answer(post(here, route, body))


def test_a_stream_gives_the_answer_of_a_plain_request(there: ServerHandle) -> None:
    body = {"prompt": "Once upon a time", "seed": 5, "max_tokens": 16, "max_denoising_steps": 4}
    (plain,), _ = answer(post(there, "completions", body))
    text = ""
    with httpx.stream(
        "POST",
        f"{there.url}/v1/completions",
        json={"model": there.model_name, **body, "stream": True},
        timeout=TIMEOUT,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == plain["text"] and text


def test_a_client_that_goes_away_aborts_its_request_in_the_engine_process(
    there: ServerHandle,
) -> None:
    body = {"model": there.model_name, "prompt": "go on", "max_tokens": 2000, "stream": True}
    body |= {"ignore_eos": True, "mode": "ar"}  # a chunk per step
    with httpx.stream("POST", f"{there.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # the client goes away mid-answer
    engine = there.state.engine

    def released() -> bool:
        stats = engine.stats
        return stats.num_inflight == 0 and stats.num_running == 0 and stats.kv_usage == 0

    wait_until(released)
    assert answer(post(there, "completions", {"prompt": "again", "max_tokens": 8, "mode": "ar"}))


def test_a_bad_schema_is_a_400_naming_the_field(there: ServerHandle) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    response = post(
        there,
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": bad},
    )
    assert response.status_code == 400, response.text
    assert "response_format" in response.text


def test_the_step_listeners_see_every_step_and_the_cache_resets(there: ServerHandle) -> None:
    """The metrics' step histogram (fed by `on_step` in the serving process) counts the steps
    the engine process reports."""
    answer(post(there, "completions", {"prompt": "count", "max_tokens": 8, "mode": "ar"}))

    def counted() -> tuple[float, float]:
        text = httpx.get(f"{there.url}/metrics", timeout=TIMEOUT).text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            values[name.split("{")[0]] = value
        return float(values["canvas:step_seconds_count"]), float(
            values["canvas:engine_steps_total"]
        )

    wait_until(lambda: counted()[0] == counted()[1] > 0)
    reset = httpx.post(f"{there.url}/reset_prefix_cache", timeout=TIMEOUT)
    assert reset.status_code == 200 and reset.json()["pages_forgotten"] == 0


# Two servers over the vision checkpoint, one spawning its engine: ~7 s on 2 busy cores.
def test_an_image_chat_gives_the_in_process_answer(vision_checkpoint: Path) -> None:
    """The image is prepared here and pickled to the engine process, whose tower encodes it."""
    image = {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(40, 60)))}}
    content = [image, {"type": "text", "text": "What is in the picture?"}]
    body = {"messages": [{"role": "user", "content": content}], "seed": 1, "max_tokens": 16}
    body |= {"max_denoising_steps": 4}
    answers = []
    for extra in ((), ("--engine-process",)):
        with serve_in_thread(vision_checkpoint, [*COMMON, *extra]) as server:
            answers.append(answer(post(server, "chat/completions", body)))
    assert answers[0] == answers[1] and answers[0][1]["prompt_tokens"] > 40


def test_a_tensor_parallel_engine_process_is_refused_by_name(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", str(checkpoint), "--port", "0", "-tp", "2", "--engine-process"]
    assert main(argv) == 2
    assert "--engine-process is not run with --tensor-parallel-size" in capsys.readouterr().err


def test_a_start_up_error_is_the_in_process_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", str(tmp_path / "missing"), "--port", "0", *COMMON]
    assert main(argv) == 2
    expected = capsys.readouterr().err
    assert main([*argv, "--engine-process"]) == 2
    assert capsys.readouterr().err == expected and str(tmp_path / "missing") in expected


def test_a_dead_engine_process_turns_health_503_and_fails_requests(there: ServerHandle) -> None:
    """The module's last test on `there`: it takes its engine down."""
    engine = there.state.engine
    assert isinstance(engine, RemoteEngine) and engine.proc.pid is not None
    os.kill(engine.proc.pid, signal.SIGKILL)
    assert "the engine process exited (code -9)" in unhealthy_reason(there.url)
    response = post(there, "completions", {"prompt": "hi", "max_tokens": 4})
    assert response.status_code >= 500


def poison_forwards() -> None:
    """An engine process's setup (run there): every forward raises a CUDA error the context
    does not survive."""
    import torch

    from engine.runner import ModelRunner

    def execute(self: ModelRunner, step: Any) -> Any:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    ModelRunner.execute = execute  # type: ignore[method-assign]


def test_a_cuda_error_in_the_engine_process_fails_its_requests_and_the_engine(
    checkpoint: Path,
) -> None:
    """As in process (tests/server/test_device_failure.py): the request fails with the error,
    and the engine for good (`stats.failure`: /health 503, `canvas serve` exits 3)."""
    config = BuildConfig(CheckpointConfig(checkpoint, device="cpu", kernels="twins"))
    engine = RemoteEngine(EngineSpec(config, warmup=False, setup=poison_forwards))
    params = RequestValidator(engine.info.defaults, engine.limits).validate(
        [1, 2, 3], SamplingParams(max_tokens=4)
    )

    async def run() -> None:
        engine.start(asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="GPU context is lost.*illegal memory access"):
            async for _ in engine.generate("r1", [1, 2, 3], params):
                pass
        for _ in range(100):  # the next report says why
            if engine.stats.failure:
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(run())
        stats = engine.stats
        assert "illegal memory access" in stats.failure and not stats.healthy
    finally:
        engine.shutdown()
    assert engine.proc.exitcode == 0  # released by its closed pipe, not killed


@pytest.fixture(scope="module")
def doomed(checkpoint: Path) -> Iterator[dict[str, ServeProcess]]:
    """A `canvas serve --engine-process` for each way `test_a_dead_process_ends_the_other`
    takes one down, both started at once (each start is seconds)."""
    flags = [*COMMON, "--engine-process"]
    with serve_processes((checkpoint, flags), (checkpoint, flags)) as servers:
        yield dict(zip(("engine", "server"), servers, strict=True))


@pytest.mark.slow  # real `canvas serve` processes and their engine processes: ~15 s on 2 cores
@pytest.mark.parametrize("dies", ["engine", "server"])
def test_a_dead_process_ends_the_other(doomed: dict[str, ServeProcess], dies: str) -> None:
    """The engine process killed: `canvas serve` exits 3 naming it. The serving process
    killed: the engine process sees its pipe close and exits."""
    server = doomed[dies]
    (engine,) = followers(children(server.process.pid))
    assert answer(post_to(server.url, {"prompt": "hi", "max_tokens": 4}))
    reason = "the engine process exited (code -9)"
    kill_and_check(server, engine if dies == "engine" else None, reason)


def post_to(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=TIMEOUT)
