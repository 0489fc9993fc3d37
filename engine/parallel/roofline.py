"""The communication of the parallel model (`engine.parallel.layers`) and of the sampler
sharded over the vocabulary (`engine.parallel.sampler`) per step, and its time on a link: the
accounting behind docs/parallelism.md's roofline for N GPUs, checked against the bytes a gloo
world moves (tests/e2e/test_parallel_tp.py, tests/e2e/test_parallel_sampler.py).

Payload: the bytes of a collective's result on one rank. A ring all-reduce puts
2 (W - 1) / W of its payload on each rank's link, an all-gather (W - 1) / W. Tensor and expert
parallelism move the same bytes: both end the MoE with one all-reduce of [N, H]. The table's
last variant (a layer's dense-MLP and MoE all-reduces made as one) is counted, not built.

    python -m engine.parallel.roofline   # the table in docs/parallelism.md
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import TextConfig
from engine.parallel.sampler import NUM_IDS, NUM_STATS


@dataclass(frozen=True, slots=True)
class Collectives:
    """The collectives of some work: all-reduce and all-gather payload bytes and calls."""

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_bytes: int = 0
    all_gather_calls: int = 0

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(
            self.all_reduce_bytes + other.all_reduce_bytes,
            self.all_reduce_calls + other.all_reduce_calls,
            self.all_gather_bytes + other.all_gather_bytes,
            self.all_gather_calls + other.all_gather_calls,
        )


@dataclass(frozen=True, slots=True)
class Link:
    """A GPU-to-GPU link: bandwidth per direction per GPU (bytes/s, what NCCL's bus bandwidth
    reaches) and the fixed cost of one collective (s)."""

    name: str
    bandwidth: float
    latency: float


# Assumed, not measured: NVLink 4 on H100/H200 SXM (450 GB/s per direction, NCCL reaching
# about 80% of it); PCIe Gen5 x16 between two cards (64 GB/s per direction, about 70%).
LINKS = (Link("NVLink (H100/H200 SXM)", 360e9, 10e-6), Link("PCIe Gen5 x16", 45e9, 20e-6))


def forward_collectives(
    cfg: TextConfig,
    num_tokens: int,
    num_decode_tokens: int,
    num_logit_rows: int,
    dtype_bytes: int,
    fused_ffn: bool = False,
) -> Collectives:
    """One forward over `num_tokens` packed tokens, `num_decode_tokens` of them in canvases
    (self-conditioned), then the LM head over `num_logit_rows` rows: the embedding's
    all-reduce, the self-conditioning MLP's, three per layer (attention, dense MLP, MoE), and
    the logits' all-gather (in the model dtype). `fused_ffn`: a layer's dense-MLP and MoE
    outputs all-reduced as one [N, 2H] tensor (the same bytes, one call fewer per layer)."""
    row = cfg.hidden_size * dtype_bytes
    per_layer = [num_tokens, 2 * num_tokens] if fused_ffn else [num_tokens] * 3
    reduce_rows = [num_tokens] + per_layer * cfg.num_layers
    if num_decode_tokens:
        reduce_rows.append(num_decode_tokens)
    gather = Collectives(0, 0, num_logit_rows * cfg.vocab_size * dtype_bytes, 1)
    if not num_logit_rows:
        gather = Collectives()
    return Collectives(sum(reduce_rows) * row, len(reduce_rows)) + gather


def soft_embed_collectives(cfg: TextConfig, num_rows: int, dtype_bytes: int) -> Collectives:
    """The soft embedding of `num_rows` positions: one all-reduce of [rows, H]."""
    return Collectives(num_rows * cfg.hidden_size * dtype_bytes, 1)


def wire_seconds(work: Collectives, size: int, link: Link) -> float:
    """The time of `work`'s collectives over `size` ranks on `link` (ring algorithms, no
    overlap with compute)."""
    if size == 1:
        return 0.0
    share = (size - 1) / size
    wire = 2 * share * work.all_reduce_bytes + share * work.all_gather_bytes
    calls = work.all_reduce_calls + work.all_gather_calls
    return wire / link.bandwidth + calls * link.latency


def sampler_collectives(num_positions: int, size: int) -> Collectives:
    """The vocabulary-sharded sampler (`engine.parallel.sampler`) over `num_positions` and
    `size` ranks: the all-gather of every rank's NUM_STATS fp32 statistics per position and the
    all-reduce of the NUM_IDS int64 picked ids; nothing of vocabulary size. Its soft embedding
    adds `soft_embed_collectives`."""
    stats = Collectives(0, 0, num_positions * size * NUM_STATS * 4, 1)
    return stats + Collectives(num_positions * NUM_IDS * 8, 1)


def denoise_step(
    cfg: TextConfig,
    num_canvases: int,
    size: int,
    sharded_sampler: bool,
    fused_ffn: bool = False,
    canvas: int = 256,
) -> Collectives:
    """A denoise step's collectives over `size` ranks (bf16): the forward over every canvas,
    its logits all-gathered and the soft embedding of every position for the next step, or
    (`sharded_sampler`) the sampler's statistics, ids and soft embedding
    (`sampler_collectives`). `fused_ffn`: each layer's dense-MLP and MoE all-reduces made as
    one of twice the payload (the same bytes, one call fewer per layer)."""
    tokens = num_canvases * canvas
    logit_rows = 0 if sharded_sampler else tokens
    work = forward_collectives(cfg, tokens, tokens, logit_rows, 2, fused_ffn)
    if sharded_sampler:
        work += sampler_collectives(tokens, size)
    return work + soft_embed_collectives(cfg, tokens, 2)


# H100 SXM predicted one-GPU denoise step (ms) at 1, 16 and 64 canvases: docs/gpu.md's
# roofline ("GPU roofline"), which the ranks' share divides.
H100_DENOISE_MS = {1: 19.9, 16: 61.4, 64: 213.0}


# The table's variants: (sharded sampler, fused dense/MoE all-reduce).
VARIANTS = ((False, False), (True, False), (True, True))


def main() -> None:
    from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG
    from engine.model.config import parse_text_config

    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    print(
        "| ranks | canvases | logits all-gathered: MB, NVLink ms, PCIe ms, step ms (× TP=1) "
        "| sharded sampler: MB, NVLink ms, PCIe ms, step ms (× TP=1) "
        "| and dense/MoE all-reduce fused: NVLink ms, step ms (× TP=1) |"
    )
    print("|---|---|---|---|---|")
    for size in (2, 4):
        for canvases, one_gpu in H100_DENOISE_MS.items():
            cells = []
            for sharded, fused in VARIANTS:
                work = denoise_step(cfg, canvases, size, sharded, fused)
                payload = (work.all_reduce_bytes + work.all_gather_bytes) / 1e6
                nvlink, pcie = (wire_seconds(work, size, link) * 1e3 for link in LINKS)
                step = one_gpu / size + nvlink
                wire = f"{nvlink:.1f}" if fused else f"{payload:,.0f}, {nvlink:.1f}, {pcie:.1f}"
                cells.append(f"{wire}, {step:.1f} ({step / one_gpu:.3f}×)")
            print(f"| {size} | {canvases} | " + " | ".join(cells) + " |")
    print("\nSharded sampler, step × TP=1 (README):\n")
    print(
        "| split | link | "
        + " | ".join(f"{c} canvas{'es' * (c > 1)}" for c in H100_DENOISE_MS)
        + " |"
    )
    print("|---|---|" + "---|" * len(H100_DENOISE_MS))
    for size in (2, 4):
        for link in LINKS:
            ratios = [
                (one_gpu / size + wire_seconds(denoise_step(cfg, c, size, True), size, link) * 1e3)
                / one_gpu
                for c, one_gpu in H100_DENOISE_MS.items()
            ]
            print(f"| TP={size} | {link.name} | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")


if __name__ == "__main__":
    main()
