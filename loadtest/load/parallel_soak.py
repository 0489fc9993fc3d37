"""Soak of a model served over ranks: a fixed number of mixed requests to an in-process
`canvas serve --tensor-parallel-size N` (CPU processes over gloo), then what it still holds.

    python -m loadtest.load.parallel_soak [--requests 1000] [--tp 2] [--workers 8]

On the tiny `c32-window` checkpoint (built into the cache on first use), `--workers` clients
send `--requests` requests in all: completions and chats in the three decode modes, streamed
or not, with short `max_tokens`; requests that must be refused (`loadtest.load.soak.REFUSED`);
numeric extremes (`loadtest.load.fuzz`); clients that leave mid-request. Checked once all are
answered: no 5xx, no hang (an answer within `--deadline`), the engine's gauges at 0 (no running
or waiting request, no KV page held), every KV page back in the pools and the scheduler's
accounting sound (`Scheduler.check`), every follower alive until shutdown, then released
(exit code 0). Writes parallel_soak.json and prints a summary line; exit status 0 when all
held."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.load.fuzz import body_for, held_after
from loadtest.load.soak import REFUSED

MODES = ("diffusion", "ar", "hybrid")


def request_for(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """(route, body, leaves early) of one mixed request."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(2, 24)}
    body["mode"] = rng.choice(MODES)
    kind = rng.random()
    if kind < 0.45:
        body["prompt"] = [rng.randint(3, 400) for _ in range(rng.randint(1, 40))]
        body["stream"] = rng.random() < 0.5
        return "/v1/completions", body, False
    if kind < 0.7:
        body["messages"] = [{"role": "user", "content": "hello " * rng.randint(1, 30)}]
        body["stream"] = rng.random() < 0.5
        return "/v1/chat/completions", body, False
    if kind < 0.8:
        body["prompt"] = [5, 6, 7]
        changes = rng.choice(REFUSED)[0]
        assert isinstance(changes, dict)
        body.update(changes)
        return "/v1/completions", body, False
    if kind < 0.9:
        route, body = body_for(rng, "tiny")
        return route, body, False
    body.update(prompt=[5, 6, 7], max_tokens=200, stream=rng.random() < 0.5)
    return "/v1/completions", body, True


async def soak(url: str, requests: int, workers: int, deadline: float, seed: int) -> dict[str, Any]:
    """Send `requests` requests from `workers` clients; the counts by outcome."""
    statuses: Counter[str] = Counter()
    counts = Counter[str]()
    left = iter(range(requests))

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=None) as client:
            for _ in left:
                route, body, leaves = request_for(rng)
                wait = 0.2 if leaves else deadline
                try:
                    r = await asyncio.wait_for(client.post(url + route, json=body), wait)
                except TimeoutError:
                    counts["left_early" if leaves else "hangs"] += 1
                    continue
                statuses[str(r.status_code)] += 1
                if r.status_code >= 500 or (r.status_code == 200 and '"error"' in r.text[-400:]):
                    counts["server_errors"] += 1

    start = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    async with httpx.AsyncClient(timeout=60.0) as client:
        await asyncio.sleep(1.0)  # clients that left: their aborts reach the engine
        held = await held_after(client, url)
    return {
        "requests": requests,
        "seconds": round(time.monotonic() - start, 1),
        "statuses": dict(statuses),
        "server_errors": counts["server_errors"],
        "hangs": counts["hangs"],
        "left_early": counts["left_early"],
        "held_after": held,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.load.parallel_soak", description=__doc__)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--tp", type=int, default=2, help="--tensor-parallel-size")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds before a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/parallel-soak"))
    args = p.parse_args(argv)

    from engine.checkpoints.default import cache_dir
    from engine.checkpoints.tiny import make_tiny
    from loadtest.load.inprocess import serve_in_thread

    checkpoint = cache_dir() / "tiny-c32-window"
    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, "c32-window")
    flags = ["--served-model-name", "tiny", "--device", "cpu", "--tensor-parallel-size"]
    flags += [str(args.tp), "--max-num-seqs", "16", "--max-queue", "64"]
    with serve_in_thread(checkpoint, flags) as server:
        (stop,) = server.state.engine.on_shutdown
        ranks = stop.__self__  # the followers (`engine.parallel.ranks.Ranks`)
        result = asyncio.run(
            soak(server.url, args.requests, args.workers, args.deadline, args.seed)
        )
        engine = server.state.engine.engine
        engine.scheduler.check()  # idle: the step loop runs nothing meanwhile
        result["pages_in_use"] = engine.pages.usage()
        result["followers_alive"] = [p.is_alive() for p in ranks.procs]
    result["follower_exit_codes"] = [p.exitcode for p in ranks.procs]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel_soak.json").write_text(json.dumps(result, indent=2))
    print(
        f"parallel soak, TP={args.tp}, {args.workers} workers: {result['requests']} requests in "
        f"{result['seconds']} s {result['statuses']}, {result['server_errors']} 5xx, "
        f"{result['hangs']} hangs, {result['left_early']} clients left early; held after "
        f"{result['held_after']}, pages in use {result['pages_in_use']}; followers alive "
        f"{result['followers_alive']}, exit codes {result['follower_exit_codes']}"
    )
    ok = result["server_errors"] == 0 and result["hangs"] == 0 and result["pages_in_use"] == 0
    ok &= not any(result["held_after"].values()) and all(result["followers_alive"])
    return 0 if ok and result["follower_exit_codes"] == [0] * (args.tp - 1) else 1


if __name__ == "__main__":
    sys.exit(main())
