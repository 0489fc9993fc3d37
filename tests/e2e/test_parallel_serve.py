"""`canvas serve --tensor-parallel-size N` over CPU processes (gloo), end to end over HTTP: a
TP=2 server gives TP=1's greedy AR answers (text and log-probabilities) except at near ties,
with an image too; every step it runs (diffusion, hybrid, a reused prefix's page copies) is
within the forward tolerance of one device on the same inputs; it streams and aborts without
leaking a page; TP=4 and EP=2 answer, TP=4 releasing its followers at shutdown; a dead
follower takes the server down (/health 503 with the reason, exit 3), and no rank is left
behind when a follower or rank 0 dies; a taken world port is named before any rank starts.

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

from engine.model import PagedKVCache, load_model
from engine.model.config import LayerType
from engine.parallel.ranks import Ranks
from engine.runner import ModelRunner, RunOutput, StepInputs
from loadtest.load.inprocess import ServerHandle, serve_in_thread
from server.cli import main
from tests.e2e.parallel_cases import REL_TOL
from tests.e2e.serve_cases import GREEDY, TIMEOUT, assert_same_greedy, chat, near_tie_bound
from tests.media import data_url, encode, noise_image
from tests.server.process import (
    ServeProcess,
    alive,
    children,
    followers,
    kill_and_check,
    serve_processes,
    unhealthy_reason,
    wait_until,
)

PRESET = "c32-window"  # 4 q heads, 4 and 2 KV heads, 4 experts: TP 2 and 4, EP 2
COMMON = ("--device", "cpu", "--no-prefix-caching", "--kernels", "twins")
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


# The flags of each parallel `canvas serve` process the slow tests below start (and end).
IMAGE_FLAGS = ("--device", "cpu", "--kernels", "twins", "--served-model-name", "tiny")
PROCESS_FLAGS = {
    "image-tp2": [*IMAGE_FLAGS[:4], "-tp", "2"],  # over the vision checkpoint
    "tp4": [*COMMON, "-tp", "4"],
    "ep2": [*COMMON, "-tp", "2", "--enable-expert-parallel"],
}


@pytest.fixture(scope="module")
def processes(checkpoint: Path, vision_checkpoint: Path) -> Iterator[dict[str, ServeProcess]]:
    """One `canvas serve` per entry of PROCESS_FLAGS, all started at once (each start is
    seconds: its followers import torch and load their shards); each test ends its own."""
    specs = [
        (vision_checkpoint if name.startswith("image") else checkpoint, flags)
        for name, flags in PROCESS_FLAGS.items()
    ]
    with serve_processes(*specs) as servers:
        yield dict(zip(PROCESS_FLAGS, servers, strict=True))


def ranks_of(server: ServerHandle) -> Ranks:
    """The followers' handle of an in-process server (its engine stops them at shutdown)."""
    (stop,) = server.state.engine.on_shutdown
    assert isinstance(stop.__self__, Ranks)
    return stop.__self__


def test_greedy_ar_text_is_tp1s_except_at_near_ties(
    one: ServerHandle, tp2: ServerHandle, checkpoint: Path
) -> None:
    """And without log-probabilities (no row gathered whole: the sampler over each rank's
    slice alone) the TP=2 text is the same."""
    bound = near_tie_bound(checkpoint)
    plain = {**GREEDY, "logprobs": False, "top_logprobs": None}
    for prompt in PROMPTS:
        ours = chat(tp2, prompt, **GREEDY)["choices"][0]
        assert_same_greedy(ours, chat(one, prompt, **GREEDY)["choices"][0], bound)
        assert chat(tp2, prompt, **plain)["choices"][0]["message"] == ours["message"]


@pytest.mark.slow  # a vision checkpoint served at TP=1 and TP=2 (a process): ~15 s on 2 cores
def test_an_image_chat_at_tp2_is_tp1s_and_a_killed_rank_0_leaves_no_process(
    vision_checkpoint: Path, processes: dict[str, ServeProcess]
) -> None:
    """Rank 0 runs the (replicated) vision tower; its soft tokens go with the forward. Then
    rank 0 is killed: its follower sees its pipe close and exits (a follower killed: the EP=2
    test). One process serves both checks: each costs seconds to start."""
    image = {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(40, 60)))}}
    content = [image, {"type": "text", "text": "What is in the picture?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **GREEDY}
    with serve_in_thread(vision_checkpoint, IMAGE_FLAGS) as one:
        ref = httpx.post(f"{one.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert ref.status_code == 200, ref.text
    server = processes["image-tp2"]
    ours = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert len(followers(children(server.process.pid))) == 1
    kill_and_check(server, None, "")
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
    finally:  # the leader's own wrapper of `execute` stays
        runner.execute, runner.copy_sliding_pages = execute, copy


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
                # rank 0 holds its vocabulary slice of every row (other ranks' columns are
                # NaN but in the rows a feature gathers whole)
                held = ~got.isnan()
                assert bool(held[:, : ref.shape[1] // 2].all()), f"step {steps}: {name}"
                tol = REL_TOL * float(ref.abs().max())
                err = (got - ref).abs()[held]
                assert float(err.max()) <= tol, f"step {steps}: {name}"
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


def answer_and_followers(
    server: ServeProcess, one: ServerHandle, checkpoint: Path, ranks: int, split: str
) -> set[int]:
    """The processes a parallel `canvas serve` of `ranks` ranks started, after checking its
    banner (`split`), its followers and its greedy AR answer: TP=1's (but at near ties), and
    without log-probabilities (no row gathered whole: the sampler over each rank's slice
    alone) the same text."""
    started = children(server.process.pid)
    assert len(followers(started)) == ranks - 1
    assert f"  {ranks} ranks, {split}\n" in server.output  # the banner
    answers = []
    for body in (GREEDY, {**GREEDY, "logprobs": False, "top_logprobs": None}):
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json={**request, **body}, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0])
    assert answers[0]["finish_reason"] == "length" and answers[0]["message"]["content"]
    ref = chat(one, "hello there", **GREEDY)["choices"][0]
    assert_same_greedy(answers[0], ref, near_tie_bound(checkpoint))
    assert answers[1]["message"] == answers[0]["message"]
    return started


@pytest.mark.slow  # a `canvas serve` process spawning 3 followers: ~20 s on 2 cores
def test_tp4_answers_and_its_followers_exit_at_shutdown(
    one: ServerHandle, checkpoint: Path, processes: dict[str, ServeProcess]
) -> None:
    server = processes["tp4"]
    started = answer_and_followers(server, one, checkpoint, 4, "tensor parallel")
    server.signal(signal.SIGTERM)
    code, _ = server.wait(60)
    assert code == 0, server.output
    assert "exited (code" not in server.output  # released, not killed
    wait_until(lambda: not any(alive(c) for c in started), 30)


@pytest.mark.slow  # a `canvas serve` process and its spawned follower: ~15 s on 2 cores
def test_ep2_answers_and_a_dead_follower_ends_canvas_serve_leaving_no_process(
    one: ServerHandle, checkpoint: Path, processes: dict[str, ServeProcess]
) -> None:
    """A follower killed: `canvas serve` exits 3 naming it (rank 0 killed: the image test).
    One process serves both checks: each costs seconds to start."""
    server = processes["ep2"]
    started = answer_and_followers(server, one, checkpoint, 2, "experts split whole")
    (follower,) = followers(started)
    kill_and_check(server, follower, "rank 1 of the parallel model exited")


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
