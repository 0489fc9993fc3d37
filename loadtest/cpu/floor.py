"""The compute floor of a benchmark: the machine's measured fp32 GEMM rate and the FLOPs a
checkpoint's decoding costs, so that every throughput also reads as a fraction of the floor.

FLOPs per canvas (2 per multiply-add): `steps` decoder passes over the canvas (every projection,
the dense MLP, the top-k experts, the router, the self-conditioning MLP, attention over the
prefix and the canvas, the tied LM head and the soft-embedding GEMM), plus one commit pass
(encoder: projections, MLPs, experts, attention; no head), plus the canvas' share of its
request's prompt prefill (the encoder over the prompt, causal attention): the benchmark serves
without a prefix cache, so every request's prompt is computed, by Canvas and the reference
alike. The floor is `canvas_length / (flops / gemm_rate)` output tokens per second; the decode
floor (`decode_tokens_per_s`, the only floor before 2026-12-04) leaves the prompts out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.config import TextConfig


@dataclass(frozen=True, slots=True)
class Floor:
    gemm_flop_per_s: float  # measured here, fp32
    flops_per_canvas: float  # its denoising steps and its commit pass
    canvas_length: int
    prompt_flops_per_canvas: float = 0.0  # its share of its request's prompt prefill
    # The GEMM rate measured at the start of each timed round (the benchmark's: this VM's
    # rate moves by a third between minutes, so each round's runs are set against its own).
    round_rates: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        flops = self.flops_per_canvas + self.prompt_flops_per_canvas
        return self.canvas_length * self.gemm_flop_per_s / flops

    @property
    def decode_tokens_per_s(self) -> float:
        return self.canvas_length * self.gemm_flop_per_s / self.flops_per_canvas

    def with_round_rates(self, rates: Sequence[float]) -> Floor:
        """This floor at the rates measured round by round (their median the headline)."""
        if not rates:
            return self
        return replace(self, gemm_flop_per_s=statistics.median(rates), round_rates=tuple(rates))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gemm_gflop_per_s": self.gemm_flop_per_s / 1e9,
            "gflops_per_canvas": self.flops_per_canvas / 1e9,
            "gflops_prompt_per_canvas": self.prompt_flops_per_canvas / 1e9,
            "floor_tokens_per_s": self.tokens_per_s,
            "decode_floor_tokens_per_s": self.decode_tokens_per_s,
        }
        if self.round_rates:
            rounds = [replace(self, gemm_flop_per_s=rate) for rate in self.round_rates]
            out["gemm_gflop_per_s_per_round"] = [rate / 1e9 for rate in self.round_rates]
            out["floor_tokens_per_s_per_round"] = [f.tokens_per_s for f in rounds]
            out["decode_floor_tokens_per_s_per_round"] = [f.decode_tokens_per_s for f in rounds]
        return out


def measure_gemm_rate(hidden: int, rows: int = 1024, threads: int = 2, repeats: int = 5) -> float:
    """Best fp32 GEMM rate [rows x hidden] @ [hidden x 4*hidden] with `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, hidden, generator=gen)
    b = torch.randn(hidden, 4 * hidden, generator=gen)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * rows * hidden * 4 * hidden / best


def token_flops(cfg: TextConfig, decode: bool) -> float:
    """FLOPs of one token through the stack's GEMMs (no attention scores, no head)."""
    hidden = cfg.hidden_size
    total = 0.0
    for spec in cfg.layers:
        kv = spec.num_kv_heads * spec.head_dim * (2 if spec.has_v_proj else 1)
        total += hidden * (2 * cfg.num_heads * spec.head_dim + kv)  # q, o, k (+ v)
        total += 3 * hidden * cfg.intermediate_size  # dense gated MLP
        if cfg.num_experts:
            total += hidden * cfg.num_experts  # router
            total += 3 * hidden * cfg.moe_intermediate_size * cfg.top_k_experts
    if decode:
        total += 3 * hidden * cfg.intermediate_size  # the self-conditioning MLP
    return 2.0 * total


def attention_flops(cfg: TextConfig, queries: int, keys: int) -> float:
    """Scores and values of `queries` over `keys` (sliding layers: their window), all layers."""
    total = 0.0
    for spec in cfg.layers:
        seen = min(keys, cfg.sliding_window - 1 + queries) if spec.is_sliding else keys
        total += 4.0 * queries * seen * cfg.num_heads * spec.head_dim
    return total


def canvas_flops(cfg: TextConfig, canvas: int, prefix: int, steps: int) -> float:
    """FLOPs of one canvas: `steps` decoder passes and one commit pass after `prefix`."""
    attention = attention_flops(cfg, canvas, prefix + canvas)
    decode = canvas * token_flops(cfg, decode=True) + attention
    decode += 2.0 * 2 * canvas * cfg.vocab_size * cfg.hidden_size  # LM head + soft embedding
    commit = canvas * token_flops(cfg, decode=False) + attention / 2  # causal: half the scores
    return steps * decode + commit


def prompt_flops(cfg: TextConfig, prompt: int) -> float:
    """FLOPs of a prompt's prefill: the encoder over its tokens, causal attention (half the
    scores; sliding layers: their window)."""
    return prompt * token_flops(cfg, decode=False) + attention_flops(cfg, prompt, prompt) / 2


def compute_floor(
    cfg: TextConfig,
    canvas: int,
    prefix: int,
    steps: int,
    threads: int,
    prompt: int = 0,
    canvases_per_request: int = 1,
) -> Floor:
    """The floor of requests of a `prompt`-token prompt and `canvases_per_request` canvases
    (each after a `prefix` of about this length)."""
    rate = measure_gemm_rate(cfg.hidden_size, threads=threads)
    share = prompt_flops(cfg, prompt) / canvases_per_request if prompt else 0.0
    return Floor(rate, canvas_flops(cfg, canvas, prefix, steps), canvas, share)
