"""`canvas train --adapter`: stage 1 with the source frozen, learning only a decoder adapter
(`engine.model.adapter`: LoRA on DECODE rows, canvas position embeddings, the self-conditioning
block).

Each step is `canvas train`'s recipe minus the AR loss (the encoder is the source, frozen, so
there is nothing to keep): the contexts are encoded without gradients (their KV is the
decoder's read-only prefix), each canvas is corrupted with uniform noise at its own level
t ~ U(0, 1), a self-conditioning first pass runs with probability `self_cond_prob`, and the loss
is the canvas cross-entropy. Only the adapter's parameters get gradients and optimizer state.

Output: `OUT/checkpoint-{step}/` (`adapter/` and `trainer_state.pt`) every `save_every` steps
and at the last one, `OUT/adapter/` (the trained adapter: `load_model(..., adapter=...)`,
`canvas serve --adapter`), `OUT/loss_log.jsonl`. `resume` continues exactly from the latest
checkpoint (adapter, optimizer and RNG state).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.adapt.forward import TrainKVCache, train_batch, train_logits
from engine.adapt.train import (
    IGNORE,
    StepMetrics,
    TemperatureRange,
    TrainConfig,
    _data_spec,
    _start,
    corrupt,
    latest_checkpoint,
    load_sequences,
    own_aligned_memory,
    restore,
    truncate_log,
)
from engine.adapt.train_data import Example, ExampleSampler
from engine.model import DiffusionLM, Mode, load_model
from engine.model.adapter import (
    AdapterConfig,
    adapter_parameters,
    attach_adapter,
    load_adapter,
    save_adapter,
)
from engine.params import DecodingDefaults

logger = logging.getLogger(__name__)

ADAPTER_OUT = "adapter"


class EncoderPrefixes:
    """The frozen encoder's KV of each training sequence, computed once without gradients and
    shared by every example cut from it (a context is a prefix of its sequence: causal KV of
    position p does not depend on what follows). Examples whose context was shortened
    (`DataSpec.context_length`) are not prefixes: `fill` encodes those batches afresh."""

    def __init__(self, model: DiffusionLM, sampler: ExampleSampler) -> None:
        self.model = model
        self.sampler = sampler
        self._kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def fill(self, cache: TrainKVCache, picks: list[int], examples: list[Example]) -> None:
        """Give sequence i of `cache` the prefix of example i (`picks`: their pair indices)."""
        pairs = [self.sampler.pairs[p] for p in picks]
        if any(len(e.context) != start for e, (_, start) in zip(examples, pairs, strict=True)):
            self._encode(cache, [e.context for e in examples])
            return
        for i, (seq, start) in enumerate(pairs):
            if seq not in self._kv:
                ids = self.sampler.sequences[seq].ids
                one = TrainKVCache()
                self._encode(one, [ids[: max(self.sampler.sequences[seq].starts)]])
                self._kv[seq] = one.layers_of(0)
            cache.set_prefix(i, self._kv[seq], start)

    @torch.no_grad()
    def _encode(self, cache: TrainKVCache, contexts: list[tuple[int, ...]]) -> None:
        device = self.model.embed_tokens.weight.device
        lengths = [len(c) for c in contexts]
        batch = train_batch(
            Mode.ENCODE, [0] * len(contexts), lengths, self.model.cfg.sliding_window
        )
        ids = torch.tensor([tok for c in contexts for tok in c], device=device)
        self.model(ids, [], batch, cache)


def adapter_losses(
    model: DiffusionLM,
    prefixes: EncoderPrefixes,
    picks: list[int],
    cfg: TrainConfig,
    temps: TemperatureRange,
    generator: torch.Generator,
) -> tuple[torch.Tensor, float, bool]:
    """(canvas cross-entropy with its graph, mean noise level, self-conditioned?) of the batch
    of pair indices `picks`. Random draws on the CPU generator, in a fixed order: noise, then
    the self-cond coin."""
    examples = [prefixes.sampler.example(i) for i in picks]
    device = model.embed_tokens.weight.device
    num = len(examples)
    clean = torch.tensor([e.canvas for e in examples])  # [B, L]
    length = clean.shape[1]
    known = torch.arange(length)[None] < torch.tensor([e.num_known for e in examples])[:, None]
    noisy, t = corrupt(clean, known, model.cfg.vocab_size, generator)
    self_cond = bool(torch.rand((), generator=generator) < cfg.self_cond_prob)
    cache = TrainKVCache()  # sequence i: example i
    prefixes.fill(cache, picks, examples)
    contexts = [len(e.context) for e in examples]
    batch = train_batch(Mode.DECODE, contexts, [length] * num, model.cfg.sliding_window)
    noisy_ids = noisy.reshape(-1).to(device)
    soft: list[torch.Tensor | None] = [None] * num
    if self_cond:
        with torch.no_grad():
            first = train_logits(model, model(noisy_ids, soft, batch, cache)).view(num, length, -1)
            temperature = (temps.t_min + (temps.t_max - temps.t_min) * t).to(device)
            soft = list(model.soft_embed(first / temperature[:, None, None]))
    logits = train_logits(model, model(noisy_ids, soft, batch, cache))  # [B * L, V]
    targets = torch.where(known, clean, IGNORE).reshape(-1)  # [B * L]
    loss = F.cross_entropy(logits, targets.to(device), ignore_index=IGNORE)
    return loss, float(t.mean()), self_cond


def adapter_step(
    model: DiffusionLM,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    prefixes: EncoderPrefixes,
    picks: list[int],
    cfg: TrainConfig,
    temps: TemperatureRange,
    generator: torch.Generator,
    step: int,
) -> StepMetrics:
    start = time.perf_counter()
    loss, noise_level, self_cond = adapter_losses(model, prefixes, picks, cfg, temps, generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    value = loss.item()
    seconds = time.perf_counter() - start
    return StepMetrics(step, value, value, 0.0, noise_level, self_cond, seconds)


def save_adapter_checkpoint(
    cfg: TrainConfig,
    step: int,
    model: DiffusionLM,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
) -> Path:
    """OUT/checkpoint-{step}/ (adapter/ and trainer_state.pt), written through a temporary
    directory so that `resume` never sees a half-written one."""
    final = cfg.out_dir / f"checkpoint-{step}"
    tmp = cfg.out_dir / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp / ADAPTER_OUT)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "config": {k: str(v) for k, v in asdict(cfg).items()},
    }
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    logger.info("Saved %s", final)
    return final


def train_adapter(cfg: TrainConfig) -> Path:
    """Run `cfg` (with `cfg.adapter`); returns OUT/adapter."""
    started = time.monotonic()  # `max_seconds` counts the load and the distillation too
    deadline = started + cfg.max_seconds if cfg.max_seconds else None
    resume_from = _start(cfg)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    # The bare source, on the twins in exact numerics: autograd needs the PyTorch ops, and
    # exact resume needs batch-invariant values.
    model = load_model(
        cfg.model_dir,
        dtype=cfg.dtype,
        device=cfg.device,
        exact=True,
        kernels="twins",
        adapter=False,
    )
    defaults = DecodingDefaults.from_checkpoint(cfg.model_dir, model.cfg.eos_token_ids)
    spec = _data_spec(cfg, model, defaults)
    if spec.canvas_length != model.config.canvas_length:
        raise ValueError(
            f"--canvas-length {spec.canvas_length}: an adapter trains for the checkpoint's "
            f"canvas length ({model.config.canvas_length})"
        )
    # Distilled with the bare source (before the adapter is attached; AR mode is unaffected).
    distill_deadline = started + cfg.max_seconds / 2 if cfg.max_seconds else None
    sampler = ExampleSampler(load_sequences(cfg, model, spec, defaults, distill_deadline), spec)
    logger.info("Training an adapter on %d examples", len(sampler.pairs))
    if resume_from is not None:
        load_adapter(model, resume_from / ADAPTER_OUT)
    else:
        config = AdapterConfig(spec.canvas_length, cfg.adapter_rank, shift=cfg.adapter_shift)
        attach_adapter(model, config, seed=cfg.seed)
    own_aligned_memory(model)
    model.requires_grad_(False)
    params = adapter_parameters(model)
    for p in params:
        p.requires_grad_(True)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = restore(resume_from, optimizer, generator) if resume_from is not None else 0
    log = cfg.out_dir / "loss_log.jsonl"
    truncate_log(log, step)
    temps = TemperatureRange(defaults.t_min, defaults.t_max)
    prefixes = EncoderPrefixes(model, sampler)
    bar = tqdm(total=cfg.steps, initial=step, desc="canvas train", disable=not cfg.progress)
    with log.open("a") as log_file:
        while step < cfg.steps:
            step += 1
            picks = sampler.draw(cfg.batch_size, generator)
            metrics = adapter_step(
                model, optimizer, params, prefixes, picks, cfg, temps, generator, step
            )
            log_file.write(json.dumps(asdict(metrics)) + "\n")
            log_file.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.loss:.3f}")
            late = deadline is not None and time.monotonic() >= deadline
            if late or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                save_adapter_checkpoint(cfg, step, model, optimizer, generator)
            if late:
                logger.warning("--max-seconds reached: stopping at step %d", step)
                break
    bar.close()
    out = save_adapter(model.eval(), cfg.out_dir / ADAPTER_OUT)
    logger.info("Wrote %s", out)
    return out


__all__ = ["latest_checkpoint", "train_adapter"]
