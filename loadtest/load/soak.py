"""Soak: a live Canvas server under mixed, partly hostile traffic for a while, RSS sampled.

    python -m loadtest.load.soak [--seconds 300] [--workers 8] [--out bench-out/soak]   (make soak)

An in-process server on the tiny `c16` checkpoint (built into the cache on first use) gets,
from `--workers` concurrent clients in a loop: normal completions and chats (streamed or not),
requests that must be refused (bad parameters, temperatures that would overflow, an unknown
model, malformed JSON, duplicate x-request-ids), and clients that leave mid-request. Counted:
requests by status, 5xx (must be 0), hangs (no answer within --deadline), and the process RSS
at the start and the end (sampled every second). Writes soak.json and prints a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.load.fuzz import body_for, held_after

REFUSED = [  # (body changes, expected status): every one must be a clean 4xx
    ({"temperature": 1e-45}, 400),
    ({"entropy_bound": 1e308}, 400),  # once overflowed the float32 sampler state and leaked
    ({"t_max": 1e300}, 400),
    ({"t_min": "inf"}, 400),
    ({"confidence_threshold": "NaN"}, 400),
    ({"seed": 2**63}, 400),
    ({"max_tokens": 0}, 400),
    ({"t_min": "x"}, 400),
    ({"model": "nope"}, 404),
    ({"n": 99}, 400),
]


@dataclass
class SoakResult:
    seconds: float
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: int = 0
    hangs: int = 0
    left_early: int = 0
    held_after: dict[str, float] = field(default_factory=dict)  # gauges once all is done
    rss_mib: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["statuses"] = dict(self.statuses)
        out["rss_start_mib"] = self.rss_mib[0] if self.rss_mib else None
        out["rss_end_mib"] = self.rss_mib[-1] if self.rss_mib else None
        out["rss_max_mib"] = max(self.rss_mib) if self.rss_mib else None
        del out["rss_mib"]
        return out


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_request(
    client: httpx.AsyncClient, url: str, rng: random.Random, result: SoakResult, deadline: float
) -> None:
    kind = rng.random()
    body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(4, 48)}
    route, headers = "/v1/completions", {}
    if kind < 0.35:
        body["prompt"] = [rng.randint(3, 400) for _ in range(rng.randint(1, 30))]
        body["stream"] = rng.random() < 0.5
    elif kind < 0.55:
        route = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "hello " * rng.randint(1, 20)}]
        body["stream"] = rng.random() < 0.5
    elif kind < 0.65:
        body["prompt"] = [5, 6, 7]
        changes, _ = rng.choice(REFUSED)
        body.update(changes)
    elif kind < 0.75:  # numeric extremes (loadtest.load.fuzz): 4xx or served, never 5xx
        route, body = body_for(rng, "tiny")
    elif kind < 0.85:
        body["prompt"] = [5, 6, 7]
        headers = {"x-request-id": "same-id"}  # duplicates on purpose
    else:  # a client that leaves
        body.update(prompt=[5, 6, 7], max_tokens=200, stream=rng.random() < 0.5)
        try:
            await asyncio.wait_for(client.post(url + route, json=body), timeout=0.2)
        except (TimeoutError, asyncio.TimeoutError, httpx.HTTPError):
            result.left_early += 1
            return
    try:
        r = await asyncio.wait_for(client.post(url + route, json=body, headers=headers), deadline)
    except (TimeoutError, asyncio.TimeoutError):
        result.hangs += 1
        return
    result.requests += 1
    result.statuses[str(r.status_code)] += 1
    if r.status_code >= 500 or (r.status_code == 200 and '"error"' in r.text[-400:]):
        result.server_errors += 1


async def soak(url: str, seconds: float, workers: int, deadline: float, seed: int) -> SoakResult:
    result = SoakResult(seconds=seconds)
    stop = time.monotonic() + seconds

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=None) as client:
            while time.monotonic() < stop:
                await one_request(client, url, rng, result, deadline)

    async def sample() -> None:
        while time.monotonic() < stop:
            result.rss_mib.append(rss_mib())
            await asyncio.sleep(1.0)
        result.rss_mib.append(rss_mib())

    await asyncio.gather(sample(), *(worker(i) for i in range(workers)))
    async with httpx.AsyncClient(timeout=60.0) as client:
        await asyncio.sleep(1.0)  # clients that left: their aborts reach the engine
        result.held_after = await held_after(client, url)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.load.soak", description=__doc__)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds before a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/soak"))
    p.add_argument("--serve-flags", default="", help="more `canvas serve` flags, e.g. '--overlap'")
    args = p.parse_args(argv)

    import torch

    from engine.checkpoints.default import cache_dir
    from engine.checkpoints.tiny import make_tiny
    from loadtest.load.inprocess import serve_in_thread

    torch.set_num_threads(2)
    checkpoint = cache_dir() / "tiny-c16"
    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, "c16")
    flags = ["--served-model-name", "tiny", "--max-num-seqs", "16", "--max-queue", "16"]
    flags += shlex.split(args.serve_flags)
    with serve_in_thread(checkpoint, flags) as server:
        result = asyncio.run(soak(server.url, args.seconds, args.workers, args.deadline, args.seed))
    summary = result.summary()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(
        f"soak {summary['seconds']:.0f} s, {args.workers} workers: {summary['requests']} requests "
        f"{summary['statuses']}, {summary['server_errors']} 5xx, {summary['hangs']} hangs, "
        f"{summary['left_early']} clients left early; held after {summary['held_after']}; "
        f"RSS {summary['rss_start_mib']:.0f} → "
        f"{summary['rss_end_mib']:.0f} MiB (max {summary['rss_max_mib']:.0f})"
    )
    leaked = any(v != 0 for v in result.held_after.values())
    return 0 if summary["server_errors"] == 0 and summary["hangs"] == 0 and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
