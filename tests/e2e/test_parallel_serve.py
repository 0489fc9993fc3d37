"""`canvas serve --tensor-parallel-size N` over CPU processes (gloo), end to end over HTTP: a
TP=2 server gives TP=1's greedy AR answers (text and log-probabilities) except at near ties,
with an image too; every step it runs (diffusion, hybrid, a reused prefix's page copies) is
within the forward tolerance of one device on the same inputs; it streams and aborts without
leaking a page; TP=4 and EP=2 answer and release their followers at shutdown; a dead rank
takes the server down (/health 503 with the reason, exit 3) and leaves no process behind; a
taken world port is named before any rank starts.

Each server spawns its followers (each imports torch and loads its shard): seconds per server
on a small CPU, so the module starts few servers and every wait has a timeout."""

from __future__ import annotations

import contextlib
import copy as copy_module
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.model import PagedKVCache, load_model, load_model_config
from engine.model.config import LayerType
from engine.parallel.ranks import Ranks
from engine.runner import ModelRunner, RunOutput, StepInputs
from loadtest.load.inprocess import ServerHandle, serve_in_thread
from server.cli import main
from tests.e2e.parallel_cases import REL_TOL
from tests.media import data_url, encode, noise_image
from tests.server.process import (
    alive,
    children,
    followers,
    kill_and_check,
    serve_process,
    unhealthy_reason,
    wait_until,
)

PRESET = "c32-window"  # 4 q heads, 4 and 2 KV heads, 4 experts: TP 2 and 4, EP 2
COMMON = ("--device", "cpu", "--no-prefix-caching", "--kernels", "twins")
TIMEOUT = httpx.Timeout(120.0)
PROMPTS = ("Tell me a story.", "What is 2 + 2?", "hello there")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint(PRESET)


@pytest.fixture(scope="module")
def one(checkpoint: Path) -> Iterator[ServerHandle]:
    with serve_in_thread(checkpoint, COMMON) as server:
        yield server


@pytest.fixture(scope="module")
def tp2(checkpoint: Path) -> Iterator[ServerHandle]:
    """With prefix caching: a repeated prompt's sliding pages are copied on every rank."""
    flags = ("--device", "cpu", "--kernels", "twins", "--tensor-parallel-size", "2")
    with serve_in_thread(checkpoint, flags) as server:
        yield server


def ranks_of(server: ServerHandle) -> Ranks:
    """The followers' handle of an in-process server (its engine stops them at shutdown)."""
    (stop,) = server.state.engine.on_shutdown
    assert isinstance(stop.__self__, Ranks)
    return stop.__self__


def chat(server: ServerHandle, prompt: str, **body: Any) -> dict[str, Any]:
    request = {"model": server.model_name, "messages": [{"role": "user", "content": prompt}]}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={**request, **body}, timeout=TIMEOUT
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def near_tie_bound(checkpoint: Path) -> float:
    """How close TP=1's top two logits must be for TP=2 to pick the other: each logit moves by
    at most REL_TOL x max |logit| (tests/e2e/parallel_cases.py), and the soft cap bounds
    |logit|; a log-probability gap is the logits' gap."""
    cap = load_model_config(checkpoint).text.final_logit_softcapping
    assert cap is not None
    return 2 * REL_TOL * cap


def assert_same_greedy(ours: dict[str, Any], ref: dict[str, Any], bound: float) -> None:
    """Two greedy AR answers (choices with log-probabilities, the top two) are the same text,
    or part first where `ref`'s top two log-probabilities lie within `bound`; until then each
    token's log-probability is within `bound` of `ref`'s (a logit and the normaliser each move
    by at most half of it)."""
    ours_steps, ref_steps = ours["logprobs"]["content"], ref["logprobs"]["content"]
    for i, (got, want) in enumerate(zip(ours_steps, ref_steps, strict=False)):
        if got["token"] != want["token"]:
            top = [t["logprob"] for t in want["top_logprobs"]]
            assert top[0] - top[1] <= bound, f"the answers part at token {i}, not a near tie"
            return
        assert abs(got["logprob"] - want["logprob"]) <= bound, f"token {i}'s log-probability"
    assert ours["message"]["content"] == ref["message"]["content"]


GREEDY = {"mode": "ar", "temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 2}


def test_greedy_ar_text_is_tp1s_except_at_near_ties(
    one: ServerHandle, tp2: ServerHandle, checkpoint: Path
) -> None:
    bound = near_tie_bound(checkpoint)
    for prompt in PROMPTS:
        ours = chat(tp2, prompt, **GREEDY)["choices"][0]
        assert_same_greedy(ours, chat(one, prompt, **GREEDY)["choices"][0], bound)


@pytest.mark.slow  # a vision checkpoint served at TP=1 and TP=2 (a process): ~25 s on 2 cores
def test_an_image_chat_at_tp2_is_tp1s_except_at_near_ties(vision_checkpoint: Path) -> None:
    """Rank 0 runs the (replicated) vision tower; its soft tokens go with the forward."""
    image = {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(40, 60)))}}
    content = [image, {"type": "text", "text": "What is in the picture?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **GREEDY}
    flags = ("--device", "cpu", "--kernels", "twins", "--served-model-name", "tiny")
    with serve_in_thread(vision_checkpoint, flags) as one:
        ref = httpx.post(f"{one.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert ref.status_code == 200, ref.text
    with serve_process(vision_checkpoint, [*flags[:4], "-tp", "2"]) as server:
        ours = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert ours.status_code == 200, ours.text
    assert ours.json()["usage"] == ref.json()["usage"]  # the image's tokens counted alike
    bound = near_tie_bound(vision_checkpoint)
    assert_same_greedy(ours.json()["choices"][0], ref.json()["choices"][0], bound)


@contextlib.contextmanager
def recording(server: ServerHandle) -> Iterator[list[tuple[Any, ...]]]:
    """What the server's runner does meanwhile: ("copy", pages) and ("step", inputs, output),
    in order, the inputs copied as they were (the sampler reuses its buffers and page tables
    change)."""
    runner = server.state.engine.engine.runner
    events: list[tuple[Any, ...]] = []
    execute, copy = runner.execute, runner.copy_sliding_pages

    def record_step(step: StepInputs) -> RunOutput:
        frozen = copy_module.deepcopy(step)
        output = execute(step)
        events.append(("step", frozen, copy_module.deepcopy(output)))
        return output

    def record_copy(copies: tuple[tuple[int, int], ...]) -> None:
        events.append(("copy", copies))
        copy(copies)

    runner.execute, runner.copy_sliding_pages = record_step, record_copy
    try:
        yield events
    finally:
        del runner.execute, runner.copy_sliding_pages


def replay(events: list[tuple[Any, ...]], server: ServerHandle, checkpoint: Path) -> int:
    """Run the recorded steps again on one device (a runner with the same pools) and check
    each step's logits within the forward tolerance of the recorded ones; returns the steps."""
    led = server.state.engine.engine.runner
    model = load_model(checkpoint, kernels="twins", adapter=False)
    pages = {t: led.cache.keys[led.cache.layer_types.index(t)].shape[0] for t in LayerType}
    cache = PagedKVCache(model.cfg, pages, led.cache.page_size, led.cache.keys[0].dtype)
    runner = ModelRunner(model, cache, server.state.engine.engine.scheduler.config.max_num_seqs)
    steps = 0
    for kind, *what in events:
        if kind == "copy":
            runner.copy_sliding_pages(what[0])
            continue
        inputs, recorded = what
        ours = runner.execute(inputs)
        for name in ("denoise_logits", "last_logits"):
            ref, got = getattr(ours, name), getattr(recorded, name)
            assert (ref is None) == (got is None), name
            if ref is not None:
                tol = REL_TOL * float(ref.abs().max())
                assert float((got - ref).abs().max()) <= tol, f"step {steps}: {name}"
        steps += 1
    return steps


def test_every_step_of_served_requests_is_within_tolerance_of_one_device(
    one: ServerHandle, tp2: ServerHandle, checkpoint: Path
) -> None:
    """Diffusion (a canvas's steps feed each other, so the texts part after the first step's
    rounding: compared per step, each on the same inputs), hybrid drafts and verify passes,
    and a prompt sent twice at once (the second reuses the first's prefix, copying the sliding
    window's pages the first's ring holds)."""
    long_prompt = " ".join(PROMPTS * 4)
    # the replay starts from empty pools: nothing cached before the recording may be reused
    assert httpx.post(f"{tp2.url}/reset_prefix_cache", timeout=TIMEOUT).status_code == 200
    with recording(tp2) as events:
        for mode in ("diffusion", "hybrid"):
            ours = chat(tp2, PROMPTS[0], mode=mode, seed=7, max_tokens=40)["choices"][0]
            ref = chat(one, PROMPTS[0], mode=mode, seed=7, max_tokens=40)["choices"][0]
            assert ours["finish_reason"] == ref["finish_reason"]
        with ThreadPoolExecutor(2) as pool:  # the second waits for the first's prefix
            answers = pool.map(lambda _: chat(tp2, long_prompt, mode="ar", max_tokens=24), "ab")
            assert len(list(answers)) == 2
    assert any(kind == "copy" and what for kind, *what in events), "no prefix was reused"
    assert replay(events, tp2, checkpoint) > 10


def test_a_stream_gives_the_answer_of_a_plain_request(tp2: ServerHandle) -> None:
    body = {"model": tp2.model_name, "messages": [{"role": "user", "content": "hi"}]}
    body |= {"seed": 3, "max_tokens": 16}
    plain = chat(tp2, "hi", seed=3, max_tokens=16)["choices"][0]["message"]["content"]
    # computed again, not over the cached prompt (whose last bits a canvas would amplify)
    assert httpx.post(f"{tp2.url}/reset_prefix_cache", timeout=TIMEOUT).status_code == 200
    text = ""
    with httpx.stream(
        "POST", f"{tp2.url}/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == plain


def test_an_aborted_stream_gives_its_pages_back(tp2: ServerHandle) -> None:
    body = {"model": tp2.model_name, "messages": [{"role": "user", "content": "go on"}]}
    body |= {"max_tokens": 2000, "stream": True, "mode": "ar"}
    with httpx.stream(
        "POST", f"{tp2.url}/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # the client goes away mid-answer
    engine = tp2.state.engine
    wait_until(lambda: engine.stats.num_inflight == 0 and engine.stats.num_running == 0)
    wait_until(lambda: engine.engine.pages.usage() == 0)
    assert chat(tp2, "again", max_tokens=8)["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # a real `canvas serve` process and its spawned follower: ~15 s on 2 cores
@pytest.mark.parametrize("dies", ["follower", "leader"])
def test_a_dead_rank_ends_canvas_serve_and_leaves_no_process(checkpoint: Path, dies: str) -> None:
    """A follower killed: `canvas serve` exits 3 naming it. Rank 0 killed: its follower sees
    its pipe close and exits."""
    with serve_process(checkpoint, [*COMMON, "-tp", "2"]) as server:
        (follower,) = followers(children(server.process.pid))
        reason = "rank 1 of the parallel model exited"
        kill_and_check(server, follower if dies == "follower" else None, reason)


def test_a_taken_distributed_port_is_named_before_any_rank_starts(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--model", str(checkpoint), "--port", "0", "-tp", "2"]
        assert main([*argv, "--distributed-port", str(port)]) == 2
    assert (
        f"--distributed-port / $MASTER_PORT: rank 0 cannot listen on tcp://127.0.0.1:{port}: "
        f"port {port} is in use" in capsys.readouterr().err
    )


@pytest.mark.slow  # a `canvas serve` process spawning 3 (or 1) followers: ~15 s on 2 cores
@pytest.mark.parametrize(
    "flags", [("-tp", "4"), ("-tp", "2", "--enable-expert-parallel")], ids=["tp4", "ep2"]
)
def test_tp4_and_ep2_answer_and_their_followers_exit_at_shutdown(
    checkpoint: Path, flags: tuple[str, ...]
) -> None:
    body = {"mode": "ar", "temperature": 0, "max_tokens": 12}
    with serve_process(checkpoint, [*COMMON, *flags]) as server:
        started = children(server.process.pid)
        assert len(followers(started)) == int(flags[1]) - 1
        split = "experts split whole" if "--enable-expert-parallel" in flags else "tensor parallel"
        assert f"  {flags[1]} ranks, {split}\n" in server.output  # the banner
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json={**request, **body}, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]
        assert answer["finish_reason"] == "length" and answer["message"]["content"]
        server.signal(signal.SIGTERM)
        code, _ = server.wait(60)
        assert code == 0, server.output
    assert "exited (code" not in server.output  # released, not killed
    wait_until(lambda: not any(alive(c) for c in started), 30)


def test_a_follower_that_dies_turns_health_503_with_the_reason(tp2: ServerHandle) -> None:
    """The module's last test: it takes the TP=2 server down."""
    (follower,) = ranks_of(tp2).procs
    assert follower.pid is not None
    os.kill(follower.pid, signal.SIGKILL)
    assert "rank 1 of the parallel model exited" in unhealthy_reason(tp2.url)
    response = httpx.post(
        f"{tp2.url}/v1/completions",
        json={"model": tp2.model_name, "prompt": "hi", "max_tokens": 4},
        timeout=TIMEOUT,
    )
    assert response.status_code >= 500
