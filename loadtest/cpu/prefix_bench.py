"""Prefix caching benchmark (`make bench-prefix`): the same workloads against two in-process
servers on one checkpoint, one with prefix caching (the default) and one with
`--no-prefix-caching`, and the ratios between them.

- second request: a fresh 2,000-token system prompt and a question, then the same system
  prompt and another question: the second's cached tokens (share of the shared prefix) and its
  time to first token against the first's;
- shared system prompt: `--concurrency` clients, each request the same fresh system prompt and
  its own question: requests/s and output tokens/s;
- multi-turn chat: `--conversations` conversations at once, each `--turns` turns that resend the
  whole history (system prompt, questions, answers): each conversation's total latency;
- nothing shared: `--concurrency` clients, every request its own 500-token prompt: what
  caching costs when it never hits (requests/s).

Every workload runs once per server as warm-up (other prompts), then `--repeats` rounds; in
each round both servers run it back to back on the same fresh prompts (the cache is reset
first, so the caching server computes every shared prefix once within the round), and the
ratios are taken within the round. Chat requests, streamed, diffusion mode with a fixed number
of denoising steps (random weights never converge); `--mode ar` for AR decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.cpu.bench import BenchConfig, checkpoint_for, configure_logging
from loadtest.load.prompts import WORDS

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reply:
    ttft: float
    latency: float
    cached_tokens: int
    prompt_tokens: int
    output_tokens: int
    text: str


@dataclass(frozen=True, slots=True)
class Settings:
    url: str
    model: str
    mode: str
    max_tokens: int
    steps: int

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "seed": 0,
            "mode": self.mode,
        }
        if self.mode == "diffusion":
            body.update(max_denoising_steps=self.steps, confidence_threshold=0)
        return body


async def chat(client: httpx.AsyncClient, s: Settings, messages: list[dict[str, str]]) -> Reply:
    """One streamed chat request, timed."""
    sent = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with client.stream("POST", f"{s.url}/v1/chat/completions", json=s.body(messages)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            for choice in chunk.get("choices") or ():
                if content := (choice.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    text.append(content)
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - sent
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        ttft if ttft is not None else latency,
        latency,
        int(details.get("cached_tokens", 0)),
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
        "".join(text),
    )


def words(rng: random.Random, num_chars: int) -> str:
    """Text of about `num_chars` characters (the byte-level test tokenizer: ~1 token each)."""
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < num_chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:num_chars]


def system(rng: random.Random, num_tokens: int) -> dict[str, str]:
    return {"role": "system", "content": words(rng, num_tokens)}


def question(rng: random.Random) -> dict[str, str]:
    return {"role": "user", "content": f"Question {rng.randrange(10**6)}: {words(rng, 60)}?"}


async def shared_prefix(
    client: httpx.AsyncClient, s: Settings, *chats: list[dict[str, str]]
) -> int:
    """The number of leading tokens the chats' prompts have in common (/tokenize)."""
    prompts = []
    for messages in chats:
        r = await client.post(f"{s.url}/tokenize", json={"model": s.model, "messages": messages})
        prompts.append(r.json()["tokens"])
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common


async def second_request(client: httpx.AsyncClient, s: Settings, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    shared = system(rng, 2000)
    chats = [shared, question(rng)], [shared, question(rng)]
    first = await chat(client, s, chats[0])
    second = await chat(client, s, chats[1])
    prefix = await shared_prefix(client, s, *chats)
    return {
        "cold_ttft": first.ttft,
        "warm_ttft": second.ttft,
        "cached_share": second.cached_tokens / prefix,
    }


async def shared_system(
    client: httpx.AsyncClient,
    s: Settings,
    seed: int,
    concurrency: int,
    num_requests: int,
    shared_tokens: int = 2000,
) -> dict[str, float]:
    """`num_requests` requests from `concurrency` clients, each a system prompt of
    `shared_tokens` (the same for all; 0: each its own of 500) and its own question."""
    rng = random.Random(seed)
    shared = system(rng, shared_tokens)
    bodies = [
        [shared if shared_tokens else system(rng, 500), question(rng)] for _ in range(num_requests)
    ]
    queue = iter(bodies)
    replies: list[Reply] = []

    async def worker() -> None:
        for messages in queue:
            replies.append(await chat(client, s, messages))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "requests_per_s": len(replies) / elapsed,
        "output_tokens_per_s": sum(r.output_tokens for r in replies) / elapsed,
        "mean_ttft": statistics.fmean(r.ttft for r in replies),
        "cached_share": sum(r.cached_tokens for r in replies)
        / sum(r.prompt_tokens for r in replies),
    }


async def multi_turn(
    client: httpx.AsyncClient, s: Settings, seed: int, conversations: int, turns: int
) -> dict[str, float]:
    async def conversation(index: int) -> tuple[float, int, int]:
        rng = random.Random(seed * 1000 + index)
        history = [system(rng, 500)]
        start, cached, prompt = time.perf_counter(), 0, 0
        for _ in range(turns):
            history.append(question(rng))
            reply = await chat(client, s, history)
            history.append({"role": "assistant", "content": reply.text})
            cached, prompt = cached + reply.cached_tokens, prompt + reply.prompt_tokens
        return time.perf_counter() - start, cached, prompt

    done = await asyncio.gather(*(conversation(i) for i in range(conversations)))
    return {
        "mean_conversation_s": statistics.fmean(d[0] for d in done),
        "cached_share": sum(d[1] for d in done) / sum(d[2] for d in done),
    }


WORKLOADS = ("second_request", "shared_system", "multi_turn", "no_sharing")
RATIOS = {  # the ratio each workload is judged by: (metric, caching on / off)
    "second_request": "warm_ttft",
    "shared_system": "requests_per_s",
    "multi_turn": "mean_conversation_s",
    "no_sharing": "requests_per_s",
}


async def run_workload(
    name: str, client: httpx.AsyncClient, s: Settings, seed: int, args: argparse.Namespace
) -> dict[str, float]:
    if name == "second_request":
        return await second_request(client, s, seed)
    if name == "shared_system":
        return await shared_system(client, s, seed, args.concurrency, args.num_requests)
    if name == "no_sharing":
        return await shared_system(client, s, seed, args.concurrency, args.num_requests, 0)
    return await multi_turn(client, s, seed, args.conversations, args.turns)


async def measure(urls: dict[str, str], model: str, args: argparse.Namespace) -> dict[str, Any]:
    """{workload: {"on"|"off": [metrics per round]}}: warm-up, then the timed rounds."""
    settings = {
        k: Settings(u, model, args.mode, args.max_tokens, args.steps) for k, u in urls.items()
    }
    results: dict[str, Any] = {w: {"on": [], "off": []} for w in args.workloads}
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for round_ in range(-1, args.repeats):  # round -1: warm-up, not recorded
            for workload in args.workloads:
                for side in ("on", "off"):
                    await client.post(f"{urls[side]}/reset_prefix_cache")
                    seed = 1000 * (round_ + 2) + WORKLOADS.index(workload)
                    metrics = await run_workload(workload, client, settings[side], seed, args)
                    logger.info("round %d %s caching %s: %s", round_, workload, side, metrics)
                    if round_ >= 0:
                        results[workload][side].append(metrics)
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        "| workload | metric | caching on | caching off | on / off per round |",
        "|---|---|---|---|---|",
    ]
    for workload, sides in results.items():
        for metric in sides["on"][0]:
            on = [r[metric] for r in sides["on"]]
            off = [r[metric] for r in sides["off"]]
            ratios = [a / b if b else float("nan") for a, b in zip(on, off, strict=True)]
            judged = "**" if metric == RATIOS[workload] else ""
            lines.append(
                f"| {workload} | {judged}{metric}{judged} | {_spread(on)} | {_spread(off)} | "
                + ", ".join(f"{x:.2f}x" for x in ratios)
                + " |"
            )
        if workload == "second_request":
            cold = [r["cold_ttft"] for r in sides["on"]]
            warm = [r["warm_ttft"] for r in sides["on"]]
            per_round = ", ".join(f"{w / c:.2f}x" for w, c in zip(warm, cold, strict=True))
            lines.append(f"| {workload} | warm / cold TTFT, caching on | | | {per_round} |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


@contextlib.contextmanager
def two_servers(checkpoint: Path, flags: list[str]) -> Iterator[dict[str, str]]:
    from loadtest.load.inprocess import serve_in_thread

    with (
        serve_in_thread(checkpoint, flags) as on,
        serve_in_thread(checkpoint, [*flags, "--no-prefix-caching"]) as off,
    ):
        yield {"on": on.url, "off": off.url, "model": on.model_name}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.cpu.prefix_bench", description=__doc__)
    p.add_argument("--preset", default="bench-small", help="benchmark checkpoint preset")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--mode", choices=["diffusion", "ar"], default="diffusion")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/prefix"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    import torch

    torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(BenchConfig(preset=args.preset))
    with two_servers(checkpoint, ["--max-num-seqs", str(max(16, args.concurrency))]) as urls:
        model = urls.pop("model")
        results = asyncio.run(measure(urls, model, args))
    args.out.mkdir(parents=True, exist_ok=True)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = "python -m loadtest.cpu.prefix_bench " + argv_text
    table = report(results)
    (args.out / "results.json").write_text(json.dumps({"command": command, "results": results}))
    (args.out / "results.md").write_text(f"`{command.strip()}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
