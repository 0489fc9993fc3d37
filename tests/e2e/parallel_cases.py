"""Worlds of CPU processes (gloo) for the parallel-model tests: `spawn_world` starts one, each
rank runs a check function and saves what it found under an output directory for the test
(in the parent process) to compare with the one-device model. `run_scenario` is the forward
sequence both sides run; `lead_check` runs it with rank 0 leading and the others following
(`engine.parallel.step`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.kv_pages import KVPages, PageGeometry, PageTables
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache, Row
from engine.model.config import LayerType, TextConfig
from engine.parallel.loader import load_sharded
from engine.parallel.plan import ShardPlan
from engine.parallel.roofline import Collectives, forward_collectives, soft_embed_collectives
from engine.parallel.step import Leader, follow
from engine.parallel.world import (
    Pending,
    World,
    WorldError,
    close_world,
    free_port,
    init_world,
)

PAGE = 16
# Per forward, |parallel - one device| <= REL_TOL * max |logit|: the tolerance fast numerics
# keep of exact ones (tests/e2e/test_fast_numerics.py). Splitting a sum over ranks only
# reorders fp32 additions, as batching does.
REL_TOL = 1e-4
PROMPTS = (40, 23)  # prompt lengths of the two sequences (longer than the sliding window)


def spawn_world(check: Callable[..., None], size: int, *args: Any) -> None:
    """Run `check(world, *args)` on each rank of a new gloo world of `size` processes; raises
    when a rank fails (its traceback in the message). The ranks are forked: they start with
    what this process imported (torch and the model's modules: seconds per rank on a small
    CPU when spawned), so this process must hold no process group and no CUDA context."""
    port = free_port()
    args = (size, port, check, args)
    mp.start_processes(_rank_main, args=args, nprocs=size, join=True, start_method="fork")


def _rank_main(rank: int, size: int, port: int, check: Callable[..., None], args: Any) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    world = init_world(rank, size, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        check(world, *args)
    finally:
        close_world()


def scenario_cache(kv_cfg: TextConfig, length: int) -> tuple[PagedKVCache, list[PageTables]]:
    """The scenario's KV cache (one rank's, by `kv_cfg`) and its two sequences' page tables."""
    context = max(PROMPTS) + 2 * length
    geometry = PageGeometry(PAGE, kv_cfg.sliding_window, context, True, True)
    full, ring = geometry.full_pages(context), geometry.sliding_ring(context)
    pages = KVPages(geometry, 2 * full, 2 * ring)
    tables = [pages.allocate(context) for _ in PROMPTS]
    sizes = {LayerType.FULL: 2 * full, LayerType.SLIDING: 2 * ring}
    return PagedKVCache(kv_cfg, sizes, PAGE, torch.float32), tables


@torch.inference_mode()
def run_scenario(model: DiffusionLM | Leader, kv_cfg: TextConfig) -> dict[str, torch.Tensor]:
    """Logits [N, V] of four forwards over two sequences: a prefill of both prompts, a first
    denoise step of both canvases, a second one self-conditioned on soft embeddings (`soft`,
    [2 * canvas, H], also returned), and a mixed batch (a commit of sequence 0's canvas beside
    sequence 1's third step). Inputs come from a fixed seed: each process runs the same forwards.
    `model`: a model, or rank 0's `Leader` of one."""
    gen = torch.Generator().manual_seed(0)
    vocab, length = model.cfg.vocab_size, model.config.canvas_length
    cache, tables = scenario_cache(kv_cfg, length)

    def row(seq: int, mode: Mode, start: int, num: int) -> Row:
        t = tables[seq]
        return Row(mode, start, num, {LayerType.FULL: t.full, LayerType.SLIDING: t.sliding()})

    def forward(rows: list[Row], ids: torch.Tensor, soft: Any) -> torch.Tensor:
        batch = ForwardBatch(rows, kv_cfg.sliding_window, PAGE)
        return model.logits(model(ids, soft, batch, cache))

    out = {}
    prompts = [torch.randint(vocab, (n,), generator=gen) for n in PROMPTS]
    rows = [row(s, Mode.ENCODE, 0, n) for s, n in enumerate(PROMPTS)]
    out["prefill"] = forward(rows, torch.cat(prompts), [])
    canvases = torch.randint(vocab, (2 * length,), generator=gen)
    denoise = [row(s, Mode.DECODE, n, length) for s, n in enumerate(PROMPTS)]
    out["denoise"] = forward(denoise, canvases, [None, None])
    # Soft embeddings of fixed logits, not of the step's own: each forward gets the same
    # inputs on both sides, so the tolerance bounds one forward's error, not its amplification
    # by the next step's softmax.
    out["soft"] = model.soft_embed(torch.randn(2 * length, vocab, generator=gen) * 4)
    soft = out["soft"]  # [2 * length, H]
    out["denoise_sc"] = forward(denoise, canvases, soft)
    mixed = [row(0, Mode.ENCODE, PROMPTS[0], length), row(1, Mode.DECODE, PROMPTS[1], length)]
    out["mixed"] = forward(mixed, canvases, [soft[length:]])
    return out


def scenario_collectives(cfg: TextConfig) -> Collectives:
    """What `run_scenario` should move through the collectives (fp32), by the roofline's
    accounting (`engine.parallel.roofline`)."""
    length = 32  # the preset's canvas
    both = 2 * length
    forwards = [(sum(PROMPTS), 0), (both, both), (both, both), (both, length)]
    work = soft_embed_collectives(cfg, both, 4)
    for num_tokens, num_decode in forwards:
        work += forward_collectives(cfg, num_tokens, num_decode, num_tokens, 4)
    return work


class CountingWorld:
    """A `World` that adds up the payloads of the collectives it runs (`counted`), those it
    starts (`start_all_reduce`) also as started."""

    def __init__(self, world: World) -> None:
        self.world, self.rank, self.size, self.device = world, world.rank, world.size, world.device
        self.counted = Collectives()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.counted += Collectives(x.numel() * x.element_size(), 1)
        return self.world.all_reduce(x)

    def start_all_reduce(self, x: torch.Tensor) -> Pending:
        payload = x.numel() * x.element_size()
        self.counted += Collectives(payload, 1, 0, 0, payload, 1)
        return self.world.start_all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        out = self.world.all_gather(x, dim)
        self.counted += Collectives(0, 0, out.numel() * out.element_size(), 1)
        return out


class WholeRows(Leader):
    """A leader whose LM head gathers every row whole (serving gathers only the rows a feature
    reads: `engine.parallel.sampling`), for comparing its logits with the model's own."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.full_rows = list(range(hidden.shape[0]))
        return super().logits(hidden)


def lead_check(model: DiffusionLM, kv_cfg: TextConfig, world: World, out_dir: Path) -> None:
    """Rank 0 runs the scenario through a `Leader` and saves its logits; the others `follow`
    and save how many calls they ran."""
    if world.rank == 0:
        leader = WholeRows(model, world)
        torch.save(run_scenario(leader, kv_cfg), out_dir / "logits-led.pt")
        leader.stop()
        return
    with torch.inference_mode():
        calls = follow(model, scenario_cache(kv_cfg, model.config.canvas_length)[0], world)
    torch.save(calls, out_dir / f"followed-{world.rank}.pt")


def forward_check(world: World, checkpoint: Path, out_dir: Path) -> None:
    """Rank check: the scenario at tensor parallelism and at expert parallelism (rank 0 saves
    the logits, which every rank holds whole, and the collectives' payloads), and what each
    rank's loader read (each rank saves its sharded parameters and its byte count)."""
    for expert_parallel in (False, True):
        counting = CountingWorld(world)
        sharded = load_sharded(checkpoint, counting, expert_parallel, kernels="twins")
        logits = run_scenario(sharded.model, sharded.plan.kv_config())
        kind = "ep" if expert_parallel else "tp"
        if world.rank == 0:
            torch.save(logits, out_dir / f"logits-{kind}.pt")
            torch.save(counting.counted, out_dir / f"collectives-{kind}.pt")
        if not expert_parallel:
            lead_check(sharded.model, sharded.plan.kv_config(), world, out_dir)
        params = {
            name: p.clone()
            for name, p in sharded.model.state_dict().items()
            if sharded.plan.shard(name) is not None
        }
        torch.save(
            {"bytes_read": sharded.bytes_read, "params": params},
            out_dir / f"shard-{kind}-{world.rank}.pt",
        )


def assert_logits_match(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Every forward's logits within REL_TOL of the one-device model's, and the greedy tokens
    the same except at near ties: where each logit may move by tol, the argmax can change only
    between two logits within 2 tol of each other in the one-device model."""
    assert got.keys() == ref.keys()
    for name, expected in ref.items():
        tol = REL_TOL * float(expected.abs().max())
        err = float((got[name] - expected).abs().max())
        assert err <= tol, f"{name}: max |difference| {err:.3g} > tolerance {tol:.3g}"
        if name == "soft":
            continue
        top2 = expected.topk(2, dim=-1).values  # [N, 2]
        near_tie = top2[:, 0] - top2[:, 1] <= 2 * tol
        same = got[name].argmax(-1) == expected.argmax(-1)
        assert bool((same | near_tie).all()), f"{name}: argmax differs away from a near tie"
        assert float(near_tie.float().mean()) < 0.5, f"{name}: too many near ties to tell"


def assert_ranks_hold_own_shards(
    out_dir: Path, kind: str, plans: list[ShardPlan], full: dict[str, torch.Tensor]
) -> None:
    """Each rank of a world saved under `kind` holds exactly its part of every sharded tensor
    of the one-device state `full`, read no more bytes than its parts and the replicated
    tensors, and no two ranks hold the same part of a tensor (but a KV head replicated because
    the layer has fewer KV heads than ranks)."""
    total = sum(t.numel() * t.element_size() for t in full.values())
    held: dict[str, list[set[int]]] = {}
    for plan in plans:
        saved = torch.load(out_dir / f"shard-{kind}-{plan.rank}.pt")
        expected_bytes = 0
        for name, tensor in full.items():
            shard = plan.shard(name)
            if shard is None:
                expected_bytes += tensor.numel() * tensor.element_size()
                continue
            local = saved["params"][name]
            assert torch.equal(local, shard.take(tensor)), f"rank {plan.rank}: {name}"
            expected_bytes += local.numel() * local.element_size()
            indices = {i for start, stop in shard.ranges for i in range(start, stop)}
            held.setdefault(name, []).append(indices)
        assert saved["bytes_read"] == expected_bytes < total
    size = len(plans)
    for name, parts in held.items():
        union = set().union(*parts)
        dim = plans[0].shard(name).dim  # type: ignore[union-attr]
        if sum(map(len, parts)) == full[name].shape[dim]:
            assert len(union) == full[name].shape[dim], name  # disjoint and complete
        else:  # replicated KV heads: each part held by size / num_kv_heads ranks
            layer = plans[0].cfg.layers[int(name.split(".")[1])]
            assert name.endswith(("k_proj.weight", "v_proj.weight")), name
            assert layer.num_kv_heads < size and len(union) == full[name].shape[dim], name
            assert all(parts.count(p) == size // layer.num_kv_heads for p in parts), name


def dead_rank_check(world: World, checkpoint: Path, out_dir: Path, dead: int) -> None:
    """Rank `dead` exits once the shards are loaded; each other rank runs its part of the
    scenario (leading or following) and saves the error it got and how long it took."""
    sharded = load_sharded(checkpoint, world, kernels="twins")
    if world.rank == dead:
        os._exit(0)  # as a killed process: no goodbye to the others
    kv_cfg, start = sharded.plan.kv_config(), time.monotonic()
    try:
        if world.rank == 0:
            run_scenario(Leader(sharded.model, world), kv_cfg)
        else:
            cache = scenario_cache(kv_cfg, sharded.model.config.canvas_length)[0]
            with torch.inference_mode():
                follow(sharded.model, cache, world)
        error = "none"
    except WorldError as exc:
        error = str(exc)
    torch.save((error, time.monotonic() - start), out_dir / f"dead-{world.rank}.pt")
