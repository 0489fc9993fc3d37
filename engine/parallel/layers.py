"""The parallel model: `parallelize` rewrites a DiffusionGemma in place into one rank's shard
(gpt-fast's `apply_tp`: the layer code is unchanged; weights are cut to the rank's part and a
reduction is attached where a partial sum leaves a module).

Per layer, three all-reduces of [N, H]: attention (after the row-parallel o_proj), the dense
MLP (after the row-parallel down_proj) and the MoE (each rank's experts, or each expert's
intermediate slice, over the replicated tokens); one more after the self-conditioning MLP of a
denoise step. The embedding is vocabulary-parallel (a masked lookup, then an all-reduce); the
tied LM head computes the rank's vocabulary slice of the logits and all-gathers them, so every
rank holds the whole [N, V] logits; the soft embedding is the rank's slice of the
probabilities times its rows, then an all-reduce. Everything between the reductions (norms,
router, RoPE, residuals) runs replicated and identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.base import DiffusionLM, Embedding
from engine.model.diffusion_gemma import DiffusionGemma, Layer
from engine.model.quant import scale_of
from engine.parallel.plan import ShardPlan
from engine.parallel.world import World


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + len(weight)) of the tied embedding; `lookup`, `project` and `mix`
    return what the whole matrix's would (through `world`'s collectives)."""

    def __init__(self, weight: nn.Parameter, start: int, world: World) -> None:
        super().__init__(0, 0)
        self.weight = weight
        self.start = start
        self.world = world

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`: the rank owning each id contributes it, the others zeros."""
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [...]
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.world.all_reduce(rows * mine[..., None].to(rows.dtype))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.world.all_gather(F.linear(hidden, self.weight), dim=-1)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        local = probs[..., self.start : self.start + self.weight.shape[0]]
        return self.world.all_reduce(torch.matmul(local, self.weight))


class ParallelExperts:
    """A layer's `run_experts` over this rank's experts, then the all-reduce. With expert
    parallelism only the (token, slot) pairs routed to the rank's experts run (each as a
    one-slot token, ids shifted to the local numbering); without it every pair runs over each
    expert's intermediate slice."""

    def __init__(self, run: Callable[..., torch.Tensor], plan: ShardPlan, world: World) -> None:
        self.run = run
        self.world = world
        self.experts = plan.expert_range if plan.expert_parallel else None

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        if self.experts is None:
            return self.world.all_reduce(self.run(x, weights, ids, segments))
        lo, hi = self.experts
        # The pairs are data dependent (a host sync on a GPU, where a kernel that skips
        # foreign ids would avoid it); their token order keeps each expert's rows sorted.
        token, slot = torch.nonzero((ids >= lo) & (ids < hi), as_tuple=True)  # [P] each
        out = torch.zeros_like(x)  # [N, H]
        if token.numel():
            pair_ids = (ids[token, slot] - lo)[:, None]  # [P, 1]
            pair_weights = weights[token, slot][:, None]  # [P, 1]
            mine = self.run(x[token], pair_weights, pair_ids, [token.numel()])  # [P, H]
            out.index_add_(0, token, mine.to(out.dtype))
        return self.world.all_reduce(out)


def parallelize(model: DiffusionLM, plan: ShardPlan, world: World) -> DiffusionLM:
    """Rewrite `model` in place into rank `plan.rank`'s shard and return it: each parameter
    `plan.shard` names is cut to its part (a meta model's become meta tensors of the local
    shape, for `load_state_dict(assign=True)`), and the reductions are attached (see the
    module's docstring). ValueError for what has no parallel form yet: another backbone, a
    decoder adapter, FP8 weights."""
    if not isinstance(model, DiffusionGemma):
        raise ValueError(f"tensor parallelism runs DiffusionGemma only, not {type(model).__name__}")
    if model.adapter is not None:
        raise ValueError("tensor parallelism does not run a decoder adapter (load without one)")
    if any(scale_of(m, "weight") is not None for m in model.modules()):
        raise ValueError("tensor parallelism does not run FP8 weights (load them unquantized)")
    assert plan.cfg == model.cfg and plan.size == world.size and plan.rank == world.rank
    for name, param in list(model.named_parameters()):
        shard = plan.shard(name)
        if shard is not None:
            module_name, _, attr = name.rpartition(".")
            local = nn.Parameter(shard.take(param.data), requires_grad=False)
            setattr(model.get_submodule(module_name), attr, local)
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens.weight, plan.vocab_range[0], world
    )
    reduce = _reduce_output(world)
    model.self_conditioning.register_forward_hook(reduce)
    for layer in model.layers:
        assert isinstance(layer, Layer)
        layer.self_attn.register_forward_hook(reduce)
        layer.mlp.register_forward_hook(reduce)
        # an instance attribute over the class's method, which it wraps
        object.__setattr__(layer, "run_experts", ParallelExperts(layer.run_experts, plan, world))
    return model


def _reduce_output(world: World) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    """A forward hook that all-reduces a module's output (its partial sum over the rank's
    heads or intermediate slice)."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return world.all_reduce(output)

    return hook
