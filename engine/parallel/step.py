"""Rank 0 leads, the other ranks follow: the model calls of a step (the forward, the LM head,
the soft embedding) are made on rank 0 through a `Leader`, which broadcasts each call's inputs
before running it; every other rank runs `follow`, which receives and runs the same calls in
the same order on its shard, so all ranks meet in the same collectives. Rank 0 alone
schedules, samples and answers; the followers' outputs are the same values, unused. A rank
that dies fails the others' next collective at once with a WorldError (`world.collective`),
on the leader and on every follower: nothing waits for it.

The messages are pickled (`broadcast_object_list`): a forward's rows (page tables included),
token ids and soft embeddings. The soft embedding's message carries its scaled logits whole;
with the sampler sharded over the vocabulary (docs/parallelism.md) it carries per-row
temperatures instead, the followers holding the logits already.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.model.base import DiffusionLM, SoftEmbeds
from engine.model.kv_cache import ForwardBatch, KVCache
from engine.parallel.world import World, collective

FORWARD, LOGITS, SOFT_EMBED, STOP = "forward", "logits", "soft_embed", "stop"


class Leader:
    """Rank 0's view of the parallel model: the same calls as `DiffusionLM`'s that a step
    makes, each first broadcast to the followers. `stop` releases them."""

    def __init__(self, model: DiffusionLM, world: World) -> None:
        assert world.rank == 0, "rank 0 leads"
        self.model, self.world = model, world
        self.cfg, self.config = model.cfg, model.config

    def __call__(
        self, ids: torch.Tensor, soft: SoftEmbeds, batch: ForwardBatch, cache: KVCache
    ) -> torch.Tensor:
        """`DiffusionLM.forward` on every rank (each with its own cache)."""
        self._send(FORWARD, ids, soft, batch.rows, batch.sliding_window, batch.page_size)
        return self.model(ids, soft, batch, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`DiffusionLM.logits` of the last forward's hidden states, on every rank."""
        self._send(LOGITS)
        return self.model.logits(hidden)

    def soft_embed(self, scaled_logits: torch.Tensor) -> torch.Tensor:
        self._send(SOFT_EMBED, scaled_logits)
        return self.model.soft_embed(scaled_logits)

    def stop(self) -> None:
        """Release the followers (`follow` returns)."""
        self._send(STOP)

    def _send(self, *message: Any) -> None:
        if self.world.size > 1:
            with collective(f"the broadcast of a {message[0]} call"):
                dist.broadcast_object_list([message], src=0)


def follow(model: DiffusionLM, cache: KVCache, world: World) -> int:
    """Run rank 0's calls (`Leader`) on this rank's shard with its `cache` until rank 0 stops;
    returns how many calls ran. WorldError where a rank (rank 0 among them) has left."""
    assert world.rank > 0, "rank 0 leads"
    hidden: torch.Tensor | None = None
    calls = 0
    while True:
        box: list[Any] = [None]
        with collective("the wait for rank 0's next call"):
            dist.broadcast_object_list(box, src=0)
        kind, *args = box[0]
        if kind == STOP:
            return calls
        if kind == FORWARD:
            ids, soft, rows, window, page_size = args
            batch = ForwardBatch(rows, window, page_size)
            hidden = model(ids.to(world.device), soft, batch, cache)
        elif kind == LOGITS:
            assert hidden is not None, "logits before a forward"
            model.logits(hidden)
        else:
            model.soft_embed(args[0].to(world.device))
        calls += 1
