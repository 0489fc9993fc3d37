"""The communication of the parallel model (`engine.parallel.layers`) and of the sampler
sharded over the vocabulary (`engine.parallel.sampler`) per step, and its time on a link: the
accounting behind docs/parallelism.md's roofline for N GPUs, checked against the bytes a gloo
world moves (tests/e2e/test_parallel_tp.py, tests/e2e/test_parallel_sampler.py).

Payload: the bytes of a collective's result on one rank. A ring all-reduce puts
2 (W - 1) / W of its payload on each rank's link, an all-gather (W - 1) / W. Tensor and expert
parallelism move the same bytes: both end the MoE with one all-reduce of [N, H]. A layer's
dense-MLP all-reduce is started and waited for after the experts (`ParallelExperts`): its time
overlaps the rank's experts' compute, so the layer pays max(experts, that all-reduce) for the
two; every other collective adds its time to the step's.

    python -m engine.parallel.roofline   # the tables in docs/parallelism.md and the README
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import TextConfig
from engine.parallel.sampler import NUM_IDS, NUM_STATS


@dataclass(frozen=True, slots=True)
class Collectives:
    """The collectives of some work: all-reduce and all-gather payload bytes and calls, and of
    the all-reduces those started and waited for later (`World.start_all_reduce`: the dense
    MLPs'), a part of the all-reduce figures."""

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_bytes: int = 0
    all_gather_calls: int = 0
    started_bytes: int = 0
    started_calls: int = 0

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (
            self.all_reduce_bytes,
            self.all_reduce_calls,
            self.all_gather_bytes,
            self.all_gather_calls,
            self.started_bytes,
            self.started_calls,
        )

    def waited(self) -> Collectives:
        """The collectives the step waits for as they run: all but the started ones."""
        return Collectives(
            self.all_reduce_bytes - self.started_bytes,
            self.all_reduce_calls - self.started_calls,
            self.all_gather_bytes,
            self.all_gather_calls,
        )


@dataclass(frozen=True, slots=True)
class Link:
    """A GPU-to-GPU link: bandwidth per direction per GPU (bytes/s, what NCCL's bus bandwidth
    reaches) and the fixed cost of one collective (s)."""

    name: str
    bandwidth: float
    latency: float


CANVAS = 256  # positions per canvas

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
    all-reduce, the self-conditioning MLP's, three per layer (attention, dense MLP, MoE; the
    dense MLP's started), and the logits' all-gather (in the model dtype)."""
    row = cfg.hidden_size * dtype_bytes
    reduce_rows = [num_tokens] * (1 + 3 * cfg.num_layers)
    if num_decode_tokens:
        reduce_rows.append(num_decode_tokens)
    dense = cfg.num_layers * num_tokens * row
    work = Collectives(sum(reduce_rows) * row, len(reduce_rows), 0, 0, dense, cfg.num_layers)
    if num_logit_rows:
        work += Collectives(0, 0, num_logit_rows * cfg.vocab_size * dtype_bytes, 1)
    return work


def soft_embed_collectives(cfg: TextConfig, num_rows: int, dtype_bytes: int) -> Collectives:
    """The soft embedding of `num_rows` positions: one all-reduce of [rows, H]."""
    return Collectives(num_rows * cfg.hidden_size * dtype_bytes, 1)


def wire_seconds(work: Collectives, size: int, link: Link) -> float:
    """The time of `work`'s collectives over `size` ranks on `link` (ring algorithms, one
    after the other, none overlapping compute)."""
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
    canvas: int = CANVAS,
) -> Collectives:
    """A denoise step's collectives over `size` ranks (bf16): the forward over every canvas,
    its logits all-gathered and the soft embedding of every position for the next step, or
    (`sharded_sampler`) the sampler's statistics, ids and soft embedding
    (`sampler_collectives`)."""
    tokens = num_canvases * canvas
    logit_rows = 0 if sharded_sampler else tokens
    work = forward_collectives(cfg, tokens, tokens, logit_rows, 2)
    if sharded_sampler:
        work += sampler_collectives(tokens, size)
    return work + soft_embed_collectives(cfg, tokens, 2)


# H100 SXM predicted one-GPU denoise step (ms) at 1, 16 and 64 canvases: docs/gpu.md's
# roofline ("GPU roofline"), which the ranks' share divides.
H100_DENOISE_MS = {1: 19.9, 16: 61.4, 64: 213.0}
# H100 SXM bf16 dense peak (FLOP/s) and memory bandwidth (bytes/s): docs/gpu.md's roofline's.
H100_FLOPS, H100_BANDWIDTH = 989e12, 3.35e12


def experts_seconds(cfg: TextConfig, num_tokens: int, size: int) -> float:
    """One layer's experts on one of `size` ranks over `num_tokens` tokens, bf16 on an H100
    (what a started dense-MLP all-reduce overlaps): max(FLOPs / peak, bytes / bandwidth) of
    the rank's 1/size of the GEMMs (each token's top_k experts: gate/up [2I, H], down [H, I])
    and of the experts' weights the tokens touch (each expert is touched unless none of the
    tokens picks it, the picks taken as uniform), as docs/gpu.md's accountant times an op.
    The router's compute, also overlapped, is left out."""
    inter, hidden, experts = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    flops = 2 * num_tokens * cfg.top_k_experts * 3 * inter * hidden
    touched = experts * (1 - (1 - cfg.top_k_experts / experts) ** num_tokens)
    weights = touched * 3 * inter * hidden * 2
    rows = 2 * num_tokens * hidden * 2  # the tokens in, the partial sums out
    return max(flops / H100_FLOPS, (weights + rows) / H100_BANDWIDTH) / size


def step_ms(
    cfg: TextConfig,
    num_canvases: int,
    size: int,
    link: Link,
    overlap: bool,
    sharded_sampler: bool = True,
) -> float:
    """The predicted H100 denoise step (ms) over `size` ranks (`denoise_step`'s collectives):
    the one-GPU step divided by `size`, plus the communication. With `overlap` (what
    `engine.parallel.layers` runs) each layer's dense-MLP all-reduce costs only what it
    outlasts the rank's experts by; without, every collective adds its whole time."""
    work = denoise_step(cfg, num_canvases, size, sharded_sampler)
    compute = H100_DENOISE_MS[num_canvases] / size
    if not overlap:
        return compute + wire_seconds(work, size, link) * 1e3
    return compute + exposed_seconds(cfg, work, num_canvases * CANVAS, size, link) * 1e3


def exposed_seconds(
    cfg: TextConfig, work: Collectives, num_tokens: int, size: int, link: Link
) -> float:
    """The time of `work`'s collectives that compute does not hide: the waited ones whole,
    and of each layer's started all-reduce (`work.started_calls`, one per layer, equal) the
    time beyond that layer's experts over `num_tokens` tokens."""
    started = Collectives(work.started_bytes // work.started_calls, 1)
    beyond = wire_seconds(started, size, link) - experts_seconds(cfg, num_tokens, size)
    return wire_seconds(work.waited(), size, link) + work.started_calls * max(0.0, beyond)


def main() -> None:
    from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG
    from engine.model.config import parse_text_config

    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    print(
        "| ranks | canvases | logits all-gathered: MB, NVLink ms, PCIe ms, step ms (× TP=1) "
        "| sharded sampler, nothing overlapped: MB, NVLink ms, PCIe ms, step ms (× TP=1) "
        "| and the dense MLP's all-reduce overlapped with the experts (built): experts ms, "
        "NVLink exposed ms, step ms (× TP=1), PCIe exposed ms, step ms (× TP=1) |"
    )
    print("|---|---|---|---|---|")
    for size in (2, 4):
        for canvases, one_gpu in H100_DENOISE_MS.items():
            cells = []
            for sharded in (False, True):
                work = denoise_step(cfg, canvases, size, sharded)
                payload = (work.all_reduce_bytes + work.all_gather_bytes) / 1e6
                wire = [wire_seconds(work, size, link) * 1e3 for link in LINKS]
                step = one_gpu / size + wire[0]
                cells.append(
                    f"{payload:,.0f}, {wire[0]:.1f}, {wire[1]:.1f}, {step:.1f} "
                    f"({step / one_gpu:.3f}×)"
                )
            tokens = canvases * CANVAS
            experts = experts_seconds(cfg, tokens, size) * 1e3
            exposed = [exposed_seconds(cfg, work, tokens, size, link) * 1e3 for link in LINKS]
            steps = [step_ms(cfg, canvases, size, link, overlap=True) for link in LINKS]
            cells.append(
                f"{experts:.2f}, "
                + ", ".join(
                    f"{e:.1f}, {t:.1f} ({t / one_gpu:.3f}×)"
                    for e, t in zip(exposed, steps, strict=True)
                )
            )
            print(f"| {size} | {canvases} | " + " | ".join(cells) + " |")
    print("\nSharded sampler, dense MLP's all-reduce overlapped, step × TP=1 (README):\n")
    print(
        "| split | link | "
        + " | ".join(f"{c} canvas{'es' * (c > 1)}" for c in H100_DENOISE_MS)
        + " |"
    )
    print("|---|---|" + "---|" * len(H100_DENOISE_MS))
    for size in (2, 4):
        for link in LINKS:
            ratios = [
                step_ms(cfg, c, size, link, overlap=True) / one_gpu
                for c, one_gpu in H100_DENOISE_MS.items()
            ]
            print(f"| TP={size} | {link.name} | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")


if __name__ == "__main__":
    main()
