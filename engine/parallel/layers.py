"""The parallel model: `parallelize` rewrites a DiffusionGemma in place into one rank's shard
(gpt-fast's `apply_tp`: the layer code is unchanged; weights are cut to the rank's part and a
reduction is attached where a partial sum leaves a module).

Per layer, three all-reduces of [N, H]: attention (after the row-parallel o_proj), the dense
MLP (after the row-parallel down_proj) and the MoE (each rank's experts, or each expert's
intermediate slice, over the replicated tokens); one more after the self-conditioning MLP of a
denoise step. The dense MLP's is started, not waited for: it runs while the rank computes the
router and its experts, and is waited for before the MoE's all-reduce (the layer reads the
dense output only after both, in its closing norms). The two cannot be summed into one
all-reduce: each branch passes its own RMSNorm before they are added, and a norm of a partial
sum is not a partial sum of norms. The embedding is vocabulary-parallel (a masked lookup, then
an all-reduce); the tied LM head computes the rank's vocabulary slice of the logits and
all-gathers them, so every rank holds the whole [N, V] logits; the soft embedding is the
rank's slice of the probabilities times its rows, then an all-reduce. Everything between the
reductions (norms, router, RoPE, residuals) runs replicated and identical on every rank."""

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
from engine.parallel.world import Pending, World


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
    expert's intermediate slice. `start_dense`, the layer's dense MLP's forward hook, starts
    that MLP's all-reduce, which the call waits for once the experts have run: the collective
    overlaps the router's and the experts' compute."""

    def __init__(self, run: Callable[..., torch.Tensor], plan: ShardPlan, world: World) -> None:
        self.run = run
        self.world = world
        self.experts = plan.expert_range if plan.expert_parallel else None
        self.dense: Pending | None = None

    def start_dense(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """Forward hook of the layer's dense MLP: start the all-reduce of its partial output
        and return that tensor, summed in place by the time the layer reads it (after the
        experts, which wait for it)."""
        self.finish_dense()  # one a failed forward left started
        self.dense = self.world.start_all_reduce(output)
        return output

    def finish_dense(self) -> None:
        """Wait for the dense MLP's all-reduce, if one is started."""
        if self.dense is not None:
            pending, self.dense = self.dense, None
            pending.wait()

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        out = self.local(x, weights, ids, segments)
        self.finish_dense()
        return self.world.all_reduce(out)

    def local(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        """This rank's partial sum of the experts' output [N, H]."""
        if self.experts is None:
            return self.run(x, weights, ids, segments)
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
        return out


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
        experts = ParallelExperts(layer.run_experts, plan, world)
        layer.mlp.register_forward_hook(experts.start_dense)
        # an instance attribute over the class's method, which it wraps
        object.__setattr__(layer, "run_experts", experts)
    return model


def _reduce_output(world: World) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    """A forward hook that all-reduces a module's output (its partial sum over the rank's
    heads or intermediate slice)."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return world.all_reduce(output)

    return hook
