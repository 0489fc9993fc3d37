"""Rank 0 leads, the other ranks follow: the model calls of a step (the forward, the LM head,
the soft embedding) and the KV cache's page copies are made on rank 0 through a `Leader`,
which sends each call's inputs to the followers before running it; every other rank runs
`follow`, which receives and runs the same calls in the same order on its shard and its own
KV cache, so all ranks meet in the same collectives. Rank 0 alone schedules, samples and
answers; the followers' outputs are the same values, unused. A rank that dies fails the
others' next collective at once with a WorldError (`world.collective`), on the leader and on
every follower: nothing waits for it.

The messages are pickled, their tensors moved to the host (a follower moves them to its own
device): a forward's rows, positions and paged rows, token ids, soft and image embeddings; the
LM head's hidden states (the rows rank 0 picked from the forward's); the soft embedding's
logits; a page copy's pages. They travel over the world (`broadcast_object_list`) or, when
serving (`engine.parallel.ranks`), over a pipe from rank 0 to each follower: an idle follower
then waits on its pipe, which never times out (a collective would, after the world's timeout)
and closes when rank 0's process ends. On NCCL they are to become fixed-layout tensors, and
the soft embedding's message per-row temperatures once the sampler is sharded over the
vocabulary (docs/parallelism.md), the followers holding the logits already.
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

from engine.model.base import DiffusionLM, ImageEmbeds, SoftEmbeds
from engine.model.config import LayerType
from engine.model.kv_cache import ForwardBatch, PagedKVCache
from engine.parallel.world import World, WorldError, collective

FORWARD, LOGITS, SOFT_EMBED, COPY, STOP = "forward", "logits", "soft_embed", "copy", "stop"


def moved(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it (in lists, tuples, dicts and dataclasses' tensor fields)
    moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        tensors = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        changes = {k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, list | tuple):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    return value


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
        self.run_forward, self.run_logits = model.forward, model.logits
        self.run_soft_embed = model.soft_embed
        self.run_copy: Callable[[LayerType, list[int], list[int]], None] | None = None
        self.lock = threading.Lock()  # the step loop sends; `stop` may come from another thread
        self.stopped = False

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
        """`DiffusionLM.logits` on every rank. The hidden states go with the call: the runner
        picks the rows it samples (every rank's forward gave the same hidden states)."""
        return self._run((LOGITS, hidden), self.run_logits, hidden)

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


def follow(
    model: DiffusionLM, cache: PagedKVCache, world: World, pipe: Connection | None = None
) -> int:
    """Run rank 0's calls (`Leader`; sent over `pipe`, None: the world) on this rank's shard
    with its `cache` until rank 0 stops; returns how many calls ran. WorldError where a rank
    (rank 0 among them) has left."""
    assert world.rank > 0, "rank 0 leads"
    calls = 0
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
            model.logits(args[0])
        elif kind == SOFT_EMBED:
            model.soft_embed(args[0])
        else:
            cache.copy_pages(*args)
        calls += 1
