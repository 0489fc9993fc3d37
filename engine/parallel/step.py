"""Rank 0 leads, the other ranks follow: the model calls of a step (the forward, the LM head,
the sampler, the soft embedding) and the KV cache's page copies are made on rank 0 through a
`Leader`, which sends each call's inputs to the followers before running it; every other rank
runs `follow`, which receives and runs the same calls in the same order on its shard and its
own KV cache, so all ranks meet in the same collectives. Rank 0 alone schedules and answers; a
follower's outputs are the same values, unused. A rank that dies fails the others' next
collective at once with a WorldError (`world.collective`), on the leader and on every
follower: nothing waits for it.

The LM head keeps each rank's vocabulary slice (`head_slice`: no all-gather of the logits);
only the rows a feature reads whole (`Leader.full_rows`, chosen per step by
`engine.parallel.sampling`) are all-gathered. Every rank samples from its slice
(`engine.parallel.sampler.ShardedSampler`, `Leader.sample`): rank 0 sends the call's rows of
the head's output, each request's logits processors (`RowEdit`), the per-position
temperatures and uniform numbers (so every rank draws alike), and reads the picked ids.

The messages are pickled, their tensors moved to the host (a follower moves them to its own
device): a forward's rows, positions and paged rows, token ids, soft and image embeddings; the
LM head's hidden states (the rows rank 0 picked from the forward's) and the rows to gather; a
sampling call's rows, edits, temperatures and uniform numbers; the rows to gather after
sampling; the soft embedding's logits; a page copy's pages. They travel over the world
(`broadcast_object_list`) or, when serving (`engine.parallel.ranks`), over a pipe from rank 0
to each follower: an idle follower then waits on its pipe, which never times out (a collective
would, after the world's timeout) and closes when rank 0's process ends. On NCCL they are to
become fixed-layout tensors (docs/parallelism.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.model.base import DiffusionLM, ImageEmbeds, SoftEmbeds
from engine.model.config import LayerType
from engine.model.kv_cache import ForwardBatch, PagedKVCache
from engine.parallel.sampler import RowEdit, ShardedSampler, apply_edits_
from engine.parallel.world import World, WorldError, collective
from kernels.reference import SampleResult

FORWARD, LOGITS, SOFT_EMBED, COPY, STOP = "forward", "logits", "soft_embed", "copy", "stop"
SAMPLE, GATHER = "sample", "gather"


def head_slice(model: DiffusionLM, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's columns [P, V_r] fp32 of the soft-capped LM head (its vocabulary-parallel
    embedding's rows): the whole head's values at those columns, with no collective."""
    raw = F.linear(hidden, model.embed_tokens.weight)
    return model.kernels.softcap(raw, model.cfg.final_logit_softcapping)


def vocab_start(model: DiffusionLM) -> int:
    """The first vocabulary id of this rank's embedding rows (0 for a whole embedding)."""
    return int(getattr(model.embed_tokens, "start", 0))


def gather_rows(world: World, local: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """`rows` of every rank's head slice all-gathered into whole rows [F, V] (None: none)."""
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=local.device)
    return world.all_gather(local[index], dim=-1)


def moved(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it (in lists, tuples, dicts and dataclasses' fields, nested
    dataclasses' too) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        changes = {k: moved(v, device) for k, v in fields.items() if _holds_tensors(v)}
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, list | tuple):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    return value


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a dataclass instance (whose tensor fields `moved` moves)."""
    dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
    return isinstance(value, torch.Tensor) or dataclass


class Leader:
    """Rank 0's view of the parallel model: the calls of `DiffusionLM` that a step makes, each
    first sent to the followers (over `pipes`, one per follower in rank order, or None: over
    the world). `lead` installs it on the model (the engine then calls it unawares);
    `copy_pages` is the KV cache's; `stop` releases the followers. A call that fails on rank 0
    raises WorldError: the followers are then inside or past a call rank 0 did not finish, and
    the world cannot run another step."""

    def __init__(
        self, model: DiffusionLM, world: World, pipes: list[Connection] | None = None
    ) -> None:
        assert world.rank == 0, "rank 0 leads"
        self.model, self.world, self.pipes = model, world, pipes
        self.cfg, self.config = model.cfg, model.config
        # the model's own methods and the cache's copy (`lead` puts this leader's in their place)
        self.run_forward = model.forward
        self.run_soft_embed = model.soft_embed
        self.run_copy: Callable[[LayerType, list[int], list[int]], None] | None = None
        self.lock = threading.Lock()  # the step loop sends; `stop` may come from another thread
        self.stopped = False
        self.sampler = ShardedSampler(world, vocab_start(model))
        # Set by the sampling before each step's head: the rows gathered whole (sorted).
        self.full_rows: list[int] = []
        self.local: torch.Tensor | None = None  # the last head's slice [P, V_r] on rank 0

    def __call__(
        self,
        ids: torch.Tensor,
        soft: SoftEmbeds,
        batch: ForwardBatch,
        cache: PagedKVCache,
        images: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """`DiffusionLM.forward` on every rank (each with its own cache). The batch goes with
        its positions and each pool's paged rows (built here if the caller has not: the
        followers' pools are numbered as rank 0's), which a bucket of the runner's persistent
        buffers (`engine.device.step_buffers`) provides instead of page tables."""
        device = ids.device
        pools = sorted(set(cache.layer_types), key=lambda t: t.value)
        paged = {t: dataclasses.replace(batch.paged_rows(t, device), memo={}) for t in pools}
        rows = (batch.rows, batch.sliding_window, batch.page_size, batch.positions(device))
        message = (FORWARD, ids, soft, *rows, paged, images)
        return self._run(message, self.run_forward, ids, soft, batch, cache, images)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on every rank, each keeping its slice (`head_slice`; rank 0's in
        `local`, for `sample`) and all-gathering only `full_rows`. Returns [P, V] fp32: rank
        0's columns, the rows of `full_rows` whole, NaN elsewhere (no other rank's logits are
        here). The hidden states go with the call: the runner picks the rows it samples
        (every rank's forward gave the same hidden states)."""
        rows = list(self.full_rows)
        return self._run((LOGITS, hidden, rows), self._head, hidden, rows)

    def _head(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.local = local = head_slice(self.model, hidden)
        whole = gather_rows(self.world, local, rows)
        out = local.new_full((local.shape[0], self.cfg.vocab_size), float("nan"))
        start = vocab_start(self.model)
        out[:, start : start + local.shape[1]] = local
        if whole is not None:
            out[torch.tensor(rows, dtype=torch.long, device=out.device)] = whole
        return out

    def gather(self, rows: list[int]) -> torch.Tensor:
        """Rows of the last head's output all-gathered whole on every rank: [len(rows), V]
        (`rows` not empty)."""
        whole = self._run((GATHER, rows), gather_rows, self.world, self.local, rows)
        assert whole is not None, "rows to gather"
        return whole

    def sample(
        self,
        rows: torch.Tensor,
        edits: list[RowEdit],
        logits: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
        weight: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> tuple[SampleResult, torch.Tensor | None]:
        """The sharded sampler on every rank over `rows` [P] of the last head's output, each
        rank's slice processed by `edits` (rank 0's: `logits` [P, V_0], processed already),
        at `temperature` and `uniform` [P]; with the embedding rows `weight`, the soft
        embedding too (`ShardedSampler.sample_and_embed`, times `scale`)."""
        message = (SAMPLE, rows, edits, temperature, uniform, weight is not None, scale)
        return self._run(
            message, run_sampler, self.sampler, logits, temperature, uniform, weight, scale
        )

    def soft_embed(
        self, scaled_logits: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._run((SOFT_EMBED, scaled_logits), self.run_soft_embed, scaled_logits, probs)

    def copy_pages(self, layer_type: LayerType, src: list[int], dst: list[int]) -> None:
        """The led cache's `copy_pages` on every rank's cache (pages are numbered alike)."""
        assert self.run_copy is not None, "lead(cache) first"
        self._run((COPY, layer_type, src, dst), self.run_copy, layer_type, src, dst)

    def lead(self, cache: PagedKVCache) -> DiffusionLM:
        """Make the model's calls and `cache`'s page copies go through this leader, so that
        what calls them (the engine's runner and sampler) runs every rank unawares: instance
        attributes over the classes' methods, as `engine.parallel.layers` wraps the experts.
        Returns the model."""
        self.run_copy = cache.copy_pages
        object.__setattr__(cache, "copy_pages", self.copy_pages)
        for name, method in (
            ("forward", self),
            ("logits", self.logits),
            ("soft_embed", self.soft_embed),
        ):
            object.__setattr__(self.model, name, method)
        return self.model

    def stop(self) -> None:
        """Release the followers (`follow` returns); idempotent. A follower already gone is
        not an error here."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(WorldError):
            self._send((STOP,))

    def _run(self, message: tuple[Any, ...], call: Callable[..., Any], *args: Any) -> Any:
        self._send(message)
        try:
            return call(*args)
        except WorldError:
            raise
        except Exception as exc:
            raise WorldError(
                f"rank 0's {message[0]} call failed ({type(exc).__name__}: {exc}); the other "
                "ranks ran it, so the ranks are out of step"
            ) from exc

    def _send(self, message: tuple[Any, ...]) -> None:
        if self.world.size == 1:
            return
        portable = moved(message, torch.device("cpu"))
        with self.lock:
            if self.pipes is None:
                with collective(f"the broadcast of a {message[0]} call"):
                    dist.broadcast_object_list([portable], src=0)
                return
            data = pickle.dumps(portable, protocol=pickle.HIGHEST_PROTOCOL)
            for rank, pipe in enumerate(self.pipes, start=1):
                try:
                    pipe.send_bytes(data)
                except OSError as exc:
                    raise WorldError(f"rank {rank} left the world ({exc})") from None


def receive(world: World, pipe: Connection | None) -> tuple[Any, ...]:
    """Rank 0's next message on this follower, its tensors on this rank's device."""
    if pipe is None:
        box: list[Any] = [None]
        with collective("the wait for rank 0's next call"):
            dist.broadcast_object_list(box, src=0)
        message = box[0]
    else:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError) as exc:
            raise WorldError(f"rank 0 left the world (its pipe closed: {exc!r})") from None
    return tuple(moved(message, world.device))


def run_sampler(
    sampler: ShardedSampler,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor | None,
    scale: float,
) -> tuple[SampleResult, torch.Tensor | None]:
    """`sampler.sample_and_embed` with `weight`, else `sampler.fused_sample` (no soft
    embedding)."""
    if weight is None:
        return sampler.fused_sample(logits, temperature, uniform), None
    return sampler.sample_and_embed(logits, temperature, uniform, weight, scale)


def follow(
    model: DiffusionLM, cache: PagedKVCache, world: World, pipe: Connection | None = None
) -> int:
    """Run rank 0's calls (`Leader`; sent over `pipe`, None: the world) on this rank's shard
    with its `cache` until rank 0 stops; returns how many calls ran. WorldError where a rank
    (rank 0 among them) has left."""
    assert world.rank > 0, "rank 0 leads"
    calls, local = 0, None  # local: the last head's slice, which sampling calls read
    sampler, start = ShardedSampler(world, vocab_start(model)), vocab_start(model)
    while True:
        kind, *args = receive(world, pipe)
        if kind == STOP:
            return calls
        if kind == FORWARD:
            ids, soft, rows, window, page_size, positions, paged, images = args
            batch = ForwardBatch(rows, window, page_size)
            batch.provide(world.device, positions, paged)
            model(ids, soft, batch, cache, images)
        elif kind == LOGITS:
            local = head_slice(model, args[0])
            gather_rows(world, local, args[1])
        elif kind == GATHER:
            assert local is not None, "a gather before the head"
            gather_rows(world, local, args[0])
        elif kind == SAMPLE:
            assert local is not None, "a sampling call before the head"
            rows, edits, temperature, uniform, embed, scale = args
            picked = local[rows]  # a copy: the edits write it
            apply_edits_(picked, start, model.cfg.vocab_size, edits)
            weight = model.embed_tokens.weight if embed else None
            run_sampler(sampler, picked, temperature, uniform, weight, scale)
        elif kind == SOFT_EMBED:
            model.soft_embed(args[0])
        else:
            cache.copy_pages(*args)
        calls += 1
