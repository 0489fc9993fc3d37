"""The communication of the parallel model (`engine.parallel.layers`) per forward, and its
time on a link: the accounting behind docs/parallelism.md's roofline for N GPUs, checked
against the bytes a gloo world moves (tests/e2e/test_parallel_tp2.py).

Payload: the bytes of a collective's result on one rank. A ring all-reduce puts
2 (W - 1) / W of its payload on each rank's link, an all-gather (W - 1) / W. Tensor and expert
parallelism move the same bytes: both end the MoE with one all-reduce of [N, H].

    python -m engine.parallel.roofline   # the table in docs/parallelism.md
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import TextConfig


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
) -> Collectives:
    """One forward over `num_tokens` packed tokens, `num_decode_tokens` of them in canvases
    (self-conditioned), then the LM head over `num_logit_rows` rows: the embedding's
    all-reduce, the self-conditioning MLP's, three per layer (attention, dense MLP, MoE), and
    the logits' all-gather (in the model dtype)."""
    row = cfg.hidden_size * dtype_bytes
    reduce_rows = [num_tokens] * (1 + 3 * cfg.num_layers)
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


# What a vocabulary-sharded sampler would all-gather per position instead of its logits
# (fp32 each, from every rank): the max, the sum of exp, the sum of exp times logit (entropy),
# the argmax, and a Gumbel-max candidate's value and id (Philox keyed by vocabulary id, so
# every rank draws as one device would).
SAMPLER_STATS = 6


def denoise_step(
    cfg: TextConfig, num_canvases: int, size: int, sharded_sampler: bool, canvas: int = 256
) -> Collectives:
    """A denoise step's collectives over `size` ranks (bf16): the forward over every canvas,
    its logits all-gathered (or, `sharded_sampler`, each rank's SAMPLER_STATS per position),
    the soft embedding of every position for the next step."""
    tokens = num_canvases * canvas
    work = forward_collectives(cfg, tokens, tokens, 0 if sharded_sampler else tokens, 2)
    if sharded_sampler:
        work += Collectives(0, 0, tokens * size * SAMPLER_STATS * 4, 1)
    return work + soft_embed_collectives(cfg, tokens, 2)


# H100 SXM predicted one-GPU denoise step (ms) at 1, 16 and 64 canvases: docs/gpu.md's
# roofline ("GPU roofline"), which the ranks' share divides.
H100_DENOISE_MS = {1: 19.9, 16: 61.4, 64: 213.0}


def main() -> None:
    from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG
    from engine.model.config import parse_text_config

    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    print(
        "| ranks | canvases | payload MB (logits) | NVLink ms | PCIe ms | step ms, × TP=1 "
        "(NVLink) | sharded sampler: NVLink ms, step ms, × TP=1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in (2, 4):
        for canvases, one_gpu in H100_DENOISE_MS.items():
            work = denoise_step(cfg, canvases, size, sharded_sampler=False)
            payload = (work.all_reduce_bytes + work.all_gather_bytes) / 1e6
            logits = work.all_gather_bytes / 1e6
            nvlink, pcie = (wire_seconds(work, size, link) * 1e3 for link in LINKS)
            step = one_gpu / size + nvlink
            sharded = denoise_step(cfg, canvases, size, sharded_sampler=True)
            nvlink_sharded = wire_seconds(sharded, size, LINKS[0]) * 1e3
            step_sharded = one_gpu / size + nvlink_sharded
            print(
                f"| {size} | {canvases} | {payload:,.0f} ({logits:,.0f}) | {nvlink:.1f} | "
                f"{pcie:.1f} | {step:.1f}, {step / one_gpu:.2f} | {nvlink_sharded:.1f}, "
                f"{step_sharded:.1f}, {step_sharded / one_gpu:.2f} |"
            )


if __name__ == "__main__":
    main()
