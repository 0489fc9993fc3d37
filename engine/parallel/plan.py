"""Which part of each DiffusionGemma parameter a rank holds (`ShardPlan.shard`), shared by the
sharded loader (`engine.parallel.loader`), which reads only those slices, and the in-place
rewrite (`engine.parallel.layers.parallelize`).

Tensor parallelism over `size` ranks, rank r:
- attention: q heads [r·Hq/W, (r+1)·Hq/W) (q_proj rows, o_proj columns); KV heads split the same
  way where W divides them, else (W a multiple of them: the full layers' 2 KV heads at W=4) each
  rank holds the one KV head its q heads read, replicated on W/Hkv ranks;
- dense MLPs (the layers' and self-conditioning's): gate/up rows and down columns of the
  intermediate range [r·I/W, (r+1)·I/W);
- embedding and tied LM head: vocabulary rows [r·V/W, (r+1)·V/W);
- experts: each expert's intermediate range (gate and up rows, down columns), or with
  `expert_parallel` whole experts [r·E/W, (r+1)·E/W);
- norms, router, layer scalars, the vision tower: replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model.config import LayerSpec, TextConfig


class Sliceable(Protocol):
    """A tensor, or a safetensors slice (`safe_open(...).get_slice(name)`): indexing reads
    only the indexed part."""

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of a full tensor one rank holds: the ranges `ranges` of dimension `dim`, in
    order, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def shape(self, full: torch.Size | list[int]) -> list[int]:
        """The local shape of a tensor of shape `full`."""
        shape = list(full)
        shape[self.dim] = sum(stop - start for start, stop in self.ranges)
        return shape

    def take(self, full: Sliceable) -> torch.Tensor:
        """This rank's part of `full`, reading only its ranges."""
        lead = (slice(None),) * self.dim
        parts = [full[(*lead, slice(start, stop))] for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def split(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s range of `total` items split evenly over `size` ranks."""
    per = total // size
    return rank * per, (rank + 1) * per


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`'s shard of a model with text config `cfg` (see the module's
    docstring); `expert_parallel`: experts split whole instead of by intermediate range.
    ValueError, naming the quantity, where `size` does not divide what it must."""

    cfg: TextConfig
    rank: int
    size: int
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        cfg, size = self.cfg, self.size
        for i, spec in enumerate(cfg.layers):
            kv = spec.num_kv_heads
            if kv % size and size % kv:
                raise ValueError(
                    f"{size} ranks must divide layer {i}'s {kv} KV heads or be a multiple of them"
                )
        need = {
            "num_attention_heads": cfg.num_heads,
            "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.intermediate_size,
        }
        if self.expert_parallel:
            need["num_experts"] = cfg.num_experts
        else:
            need["moe_intermediate_size"] = cfg.moe_intermediate_size
        for name, value in need.items():
            if value % size:
                raise ValueError(f"{size} ranks must divide {name}={value}")

    @property
    def vocab_range(self) -> tuple[int, int]:
        return split(self.cfg.vocab_size, self.rank, self.size)

    @property
    def expert_range(self) -> tuple[int, int]:
        """The experts this rank holds (all of them without `expert_parallel`)."""
        if not self.expert_parallel:
            return 0, self.cfg.num_experts
        return split(self.cfg.num_experts, self.rank, self.size)

    def kv_heads(self, spec: LayerSpec) -> tuple[int, int]:
        """The KV heads of a layer this rank holds (one, replicated, where they are fewer
        than the ranks: the one its q heads read)."""
        kv = spec.num_kv_heads
        if kv >= self.size:
            return split(kv, self.rank, self.size)
        head = self.rank * kv // self.size
        return head, head + 1

    def kv_config(self) -> TextConfig:
        """`cfg` as this rank's attention sees it: its q heads and, per layer, its KV heads
        (what its KV cache and memory plan are sized by)."""
        layers = tuple(
            dataclasses.replace(spec, num_kv_heads=self._count(self.kv_heads(spec)))
            for spec in self.cfg.layers
        )
        return dataclasses.replace(
            self.cfg, num_heads=self.cfg.num_heads // self.size, layers=layers
        )

    def shard(self, name: str) -> Shard | None:
        """The part of Canvas parameter `name` this rank holds; None: the whole (replicated)."""
        if name == "embed_tokens.weight":
            return Shard(0, (self.vocab_range,))
        parts = name.split(".")
        if parts[0] == "layers":
            spec = self.cfg.layers[int(parts[1])]
            module, param = ".".join(parts[2:-1]), parts[-1]
        elif parts[0] == "self_conditioning" and len(parts) == 3:
            spec, module, param = self.cfg.layers[0], "mlp." + parts[1], parts[2]
        else:
            return None
        return self._layer_shard(spec, module, param)

    def _layer_shard(self, spec: LayerSpec, module: str, param: str) -> Shard | None:
        rank, size, dim = self.rank, self.size, spec.head_dim
        q_lo, q_hi = split(self.cfg.num_heads, rank, size)
        kv_lo, kv_hi = self.kv_heads(spec)
        inter = split(self.cfg.intermediate_size, rank, size)
        table = {
            ("self_attn.q_proj", "weight"): Shard(0, ((q_lo * dim, q_hi * dim),)),
            ("self_attn.k_proj", "weight"): Shard(0, ((kv_lo * dim, kv_hi * dim),)),
            ("self_attn.v_proj", "weight"): Shard(0, ((kv_lo * dim, kv_hi * dim),)),
            ("self_attn.o_proj", "weight"): Shard(1, ((q_lo * dim, q_hi * dim),)),
            ("mlp.gate_proj", "weight"): Shard(0, (inter,)),
            ("mlp.up_proj", "weight"): Shard(0, (inter,)),
            ("mlp.down_proj", "weight"): Shard(1, (inter,)),
        }
        if self.expert_parallel:
            table[("experts", "gate_up_proj")] = Shard(0, (self.expert_range,))
            table[("experts", "down_proj")] = Shard(0, (self.expert_range,))
        else:
            moe = self.cfg.moe_intermediate_size
            lo, hi = split(moe, rank, size)
            table[("experts", "gate_up_proj")] = Shard(1, ((lo, hi), (moe + lo, moe + hi)))
            table[("experts", "down_proj")] = Shard(2, ((lo, hi),))
        return table.get((module, param))

    @staticmethod
    def _count(heads: tuple[int, int]) -> int:
        return heads[1] - heads[0]
