"""Load generator for OpenAI-compatible servers (Canvas or any other), on httpx + asyncio.

    python -m loadtest.load.loadgen --url http://127.0.0.1:8000 --concurrency 1,4,16 \\
        --num-requests 64 --max-tokens 128 [--request-rate 2,4] [--out DIR]

Each level of the sweep is either a fixed concurrency (closed loop: N clients, each sends its
next request when the previous one ends) or a fixed request rate (open loop: Poisson arrivals,
optionally capped by --max-concurrency). A level ends after --num-requests requests or, when
--duration is set, when no new request may start after that many seconds; every request is
bounded by --request-timeout, so a run always ends on its own. Warm-up requests go first and
are not counted. Against Canvas it also reads /metrics around each level to report the
engine's own overhead (step time outside the model forward).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.load.client import ENDPOINTS, RequestSpec, send_request
from loadtest.load.metrics import StepTotals, read_step_totals
from loadtest.load.prompts import PROMPT_SETS, Prompt, make_prompts
from loadtest.load.stats import RequestRecord, RunSummary, summarize

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Level:
    """One point of a sweep: a fixed concurrency, or a request rate (req/s; inf = all at once)
    with an optional cap on requests in flight."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a level has either a concurrency or a request rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")

    def label(self, system: str) -> str:
        if self.concurrency is not None:
            return f"{system} c={self.concurrency}"
        return f"{system} rate={self.request_rate:g}/s"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """A sweep: where, what to send, and the bounds of each level."""

    url: str
    spec: RequestSpec = field(default_factory=RequestSpec)
    model: str | None = None  # None: the first model of GET /v1/models
    prompts: tuple[Prompt, ...] = ()  # request i uses prompts[i % len(prompts)]
    num_requests: int = 64  # per level
    duration_s: float | None = None  # per level: no request starts after this
    warmup: int = 2
    seed: int = 0  # Poisson arrivals
    system: str = "canvas"  # the name runs are labelled with
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a load test needs at least one prompt")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


@dataclass(frozen=True, slots=True)
class LevelResult:
    summary: RunSummary
    records: tuple[RequestRecord, ...]


def make_client(config: LoadConfig, max_connections: int) -> httpx.AsyncClient:
    """An httpx client for the server; a server without auth accepts any bearer key."""
    headers = {"Authorization": f"Bearer {config.api_key or 'canvas'}"}
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    timeout = httpx.Timeout(config.spec.timeout_s, connect=30.0)
    return httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits, timeout=timeout)


async def resolve_model(client: httpx.AsyncClient, config: LoadConfig) -> str:
    """The configured model name, else the first one the server lists."""
    if config.model is not None:
        return config.model
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_sweep(config: LoadConfig, levels: Sequence[Level]) -> list[LevelResult]:
    """Warm up, then run every level in order (one at a time)."""
    width = max((lv.concurrency or lv.max_concurrency or 256) for lv in levels)
    async with make_client(config, width + 8) as client:
        model = await resolve_model(client, config)
        await warm_up(
            client, config, model, levels[0].concurrency or levels[0].max_concurrency or 4
        )
        return [await run_level(client, config, model, level) for level in levels]


async def warm_up(client: httpx.AsyncClient, config: LoadConfig, model: str, width: int) -> None:
    """Send `config.warmup` requests, at most `width` at a time, and forget them."""
    if not config.warmup:
        return
    warm = await _closed_loop(client, config, model, min(width, config.warmup), config.warmup, None)
    failed = [r.error for r in warm if not r.ok]
    if failed:
        logger.warning("%d of %d warm-up requests failed: %s", len(failed), len(warm), failed[0])


async def run_level(
    client: httpx.AsyncClient, config: LoadConfig, model: str, level: Level
) -> LevelResult:
    """Run one level; its duration runs from the first request sent to the last one done.
    The server's step totals are read just before and just after (engine overhead)."""
    before = await read_step_totals(client)
    if level.concurrency is not None:
        records = await _closed_loop(
            client, config, model, level.concurrency, config.num_requests, config.duration_s
        )
    else:
        records = await _open_loop(client, config, model, level, time.perf_counter())
    duration = max(r.start + r.latency for r in records) if records else 0.0
    after = await read_step_totals(client)
    overhead = StepTotals.between(before, after)
    summary = summarize(
        level.label(config.system),
        config.system,
        records,
        duration,
        concurrency=level.concurrency,
        request_rate=level.request_rate,
        engine_overhead=overhead,
    )
    logger.info(
        "%s: %d requests, %d errors, %.1f output tok/s, %.2f req/s",
        summary.label,
        summary.num_requests,
        summary.num_errors,
        summary.output_tokens_per_s,
        summary.requests_per_s,
    )
    return LevelResult(summary, tuple(sorted(records, key=lambda r: r.index)))


async def _closed_loop(
    client: httpx.AsyncClient,
    config: LoadConfig,
    model: str,
    concurrency: int,
    total: int,
    duration_s: float | None,
) -> list[RequestRecord]:
    """`concurrency` clients send `total` requests back to back; none starts after
    `duration_s` seconds (when set)."""
    origin = time.perf_counter()
    records: list[RequestRecord] = []
    claimed = 0

    def claim() -> int | None:
        nonlocal claimed
        expired = duration_s is not None and time.perf_counter() - origin >= duration_s
        if claimed >= total or expired:
            return None
        claimed += 1
        return claimed - 1

    async def worker() -> None:
        while (index := claim()) is not None:
            prompt = config.prompts[index % len(config.prompts)]
            records.append(
                await send_request(client, config.url, config.spec, model, prompt, index, origin)
            )

    await asyncio.gather(*(worker() for _ in range(min(concurrency, total))))
    return records


async def _open_loop(
    client: httpx.AsyncClient, config: LoadConfig, model: str, level: Level, start: float
) -> list[RequestRecord]:
    """Poisson arrivals at `level.request_rate`, at most `level.max_concurrency` in flight."""
    rng = random.Random(config.seed)
    gate = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
    assert level.request_rate is not None

    async def one(index: int) -> RequestRecord:
        prompt = config.prompts[index % len(config.prompts)]
        if gate is None:
            return await send_request(client, config.url, config.spec, model, prompt, index, start)
        async with gate:
            return await send_request(client, config.url, config.spec, model, prompt, index, start)

    tasks = []
    for index in range(config.num_requests):
        if config.duration_s is not None and time.perf_counter() - start >= config.duration_s:
            break
        tasks.append(asyncio.create_task(one(index)))
        if math.isfinite(level.request_rate):
            await asyncio.sleep(rng.expovariate(level.request_rate))
    return list(await asyncio.gather(*tasks))


# -- command line -------------------------------------------------------------------------------


def _numbers(kind: Callable[[str], float]) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            return [kind(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers, got {text!r}"
            ) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.load.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_numbers(int), default=None, help="e.g. 1,4,16")
    load.add_argument(
        "--request-rate", type=_numbers(float), default=None, help="req/s, e.g. 1,2,inf"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap for --request-rate")
    p.add_argument("--num-requests", type=int, default=64, help="requests per level")
    p.add_argument("--duration", type=float, default=None, help="seconds per level (bound)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, not counted")
    p.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default="short-chat")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    p.add_argument("--mode", choices=["diffusion", "ar"], default=None, help="Canvas decode mode")
    p.add_argument("--max-denoising-steps", type=int, default=None)
    p.add_argument("--confidence-threshold", type=float, default=None, help="0: fixed steps")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--request-seed", type=int, default=None, help="request i sends seed S+i")
    p.add_argument("--system", default="canvas", help="name the runs are labelled with")
    p.add_argument("--out", default="bench-out/loadgen", help="directory for JSON, markdown, plots")
    return p


def config_from_args(args: argparse.Namespace) -> tuple[LoadConfig, list[Level]]:
    spec = RequestSpec(
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        ignore_eos=args.ignore_eos,
        mode=args.mode,
        max_denoising_steps=args.max_denoising_steps,
        confidence_threshold=args.confidence_threshold,
        temperature=args.temperature,
        request_seed=args.request_seed,
        timeout_s=args.request_timeout,
    )
    prompts = make_prompts(args.prompt_set, args.num_requests, args.seed)
    config = LoadConfig(
        url=args.url.rstrip("/"),
        spec=spec,
        model=args.model,
        prompts=tuple(prompts),
        num_requests=args.num_requests,
        duration_s=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        system=args.system,
        api_key=args.api_key,
    )
    if args.request_rate:
        levels = [
            Level(request_rate=r, max_concurrency=args.max_concurrency) for r in args.request_rate
        ]
    else:
        levels = [Level(concurrency=c) for c in (args.concurrency or [1, 4, 16])]
    return config, levels


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, write the reports and print the table. 0: no request failed."""
    from loadtest.load.report import write_loadgen_report

    args = build_parser().parse_args(argv)
    try:
        config, levels = config_from_args(args)
    except ValueError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(run_sweep(config, levels))
    except httpx.HTTPError as exc:
        print(f"loadgen: error: cannot reach {config.url}: {exc}", file=sys.stderr)
        return 1
    table = write_loadgen_report(Path(args.out), config, results)
    print(table)
    return 0 if all(r.summary.num_errors == 0 for r in results) else 1


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    sys.exit(main())
