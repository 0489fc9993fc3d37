"""`canvas train --adapter`: stage 1 with the source frozen, learning only a decoder adapter
(`engine.model.adapter`: LoRA on DECODE rows, canvas position embeddings, the self-conditioning
block).

Each step is `canvas train`'s recipe minus the AR loss (the encoder is the source, frozen, so
there is nothing to keep): the contexts are encoded without gradients (their KV is the
decoder's read-only prefix), each canvas is corrupted with uniform noise at its own level
t ~ U(0, 1), a self-conditioning first pass runs with probability `self_cond_prob`, and the loss
is the canvas cross-entropy. Only the adapter's parameters get gradients and optimizer state.

`draft_regime` trains the adapter as hybrid decoding's drafter instead (`draft_losses`): the
canvas starts at every completion position, slot 0 holds the true token (the pending one),
every other position is noise (t = 1), one pass without self-conditioning (hybrid drafts with
one denoising step, `canvas_hybrid_draft_steps`), and the cross-entropy of canvas position i >= 1
is weighted by `draft_decay` ** (i - 1): the verifier accepts a prefix, so position i only
counts when 1..i-1 are right; positions past an answer's EOS have no target (a hybrid request
ends there). `standard_every` N makes every Nth step the diffusion objective above (on
canvas-boundary examples), which keeps diffusion mode from drifting away. Fine-tunes
`init_adapter` when given.

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
    corrupt,
    data_spec,
    latest_checkpoint,
    load_sequences,
    open_for_training,
    own_aligned_memory,
    prepare_out,
    restore,
    train,
    truncate_log,
)
from engine.adapt.train_data import (
    DataSpec,
    Example,
    ExampleSampler,
    TrainSequence,
    every_position,
)
from engine.model import DiffusionLM, ForwardBatch, Mode
from engine.model.adapter import (
    AdapterConfig,
    adapter_parameters,
    attach_adapter,
    load_adapter,
    save_adapter,
)

logger = logging.getLogger(__name__)

ADAPTER_OUT = "adapter"
MIN_DRAFT_WEIGHT = 1e-3  # draft_losses skips the head of canvas positions weighing less


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
    examples, clean, known = _examples(prefixes, picks)
    device = model.embed_tokens.weight.device
    num, length = clean.shape
    noisy, t = corrupt(clean, known, model.cfg.vocab_size, generator)
    self_cond = bool(torch.rand((), generator=generator) < cfg.self_cond_prob)
    cache, batch = _decode_rows(model, prefixes, picks, examples)
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


def _examples(
    prefixes: EncoderPrefixes, picks: list[int]
) -> tuple[list[Example], torch.Tensor, torch.Tensor]:
    """The batch's examples, their clean canvases [B, L] and which positions have a target
    (the known part of each canvas) [B, L]."""
    examples = [prefixes.sampler.example(i) for i in picks]
    clean = torch.tensor([e.canvas for e in examples])  # [B, L]
    known_counts = torch.tensor([e.num_known for e in examples])[:, None]
    return examples, clean, torch.arange(clean.shape[1])[None] < known_counts


def _decode_rows(
    model: DiffusionLM, prefixes: EncoderPrefixes, picks: list[int], examples: list[Example]
) -> tuple[TrainKVCache, ForwardBatch]:
    """The examples' prefix KV (sequence i: example i) and the DECODE rows of their canvases."""
    cache = TrainKVCache()
    prefixes.fill(cache, picks, examples)
    contexts = [len(e.context) for e in examples]
    length = len(examples[0].canvas)
    batch = train_batch(Mode.DECODE, contexts, [length] * len(examples), model.cfg.sliding_window)
    return cache, batch


def draft_weights(length: int, decay: float) -> torch.Tensor:
    """[L] loss weights of the draft regime: 0 for slot 0 (the pinned token), decay ** (i - 1)
    for canvas position i >= 1, cut to 0 below `MIN_DRAFT_WEIGHT`."""
    weights = decay ** (torch.arange(length, dtype=torch.float32) - 1)
    weights[0] = 0.0
    return torch.where(weights >= MIN_DRAFT_WEIGHT, weights, 0.0)


def draft_canvases(
    clean: torch.Tensor, vocab_size: int, generator: torch.Generator
) -> torch.Tensor:
    """Hybrid's first draft step of clean canvases [B, L]: slot 0 holds the true token, every
    other position a uniformly random one (the sampler's fresh canvas, t = 1)."""
    noisy = torch.randint(0, vocab_size, clean.shape, generator=generator)
    noisy[:, 0] = clean[:, 0]
    return noisy


def past_eos(canvas: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, L] bool: positions after the first EOS of each canvas (the EOS filling past a
    finished answer, which a hybrid request never drafts: it ends at the EOS)."""
    eos = (canvas == eos_id).long()
    return (eos.cumsum(dim=1) - eos) > 0


def accepted_prefix(correct: torch.Tensor) -> torch.Tensor:
    """[B] number of leading True of `correct` [B, K]: what a verifier accepts of a draft."""
    return correct.long().cumprod(dim=1).sum(dim=1)


def draft_losses(
    model: DiffusionLM,
    prefixes: EncoderPrefixes,
    picks: list[int],
    cfg: TrainConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """(weighted canvas cross-entropy with its graph, mean accepted draft tokens) of the batch
    of pair indices `picks` in the draft regime. Random draws on the CPU generator: the noise."""
    examples, clean, known = _examples(prefixes, picks)
    device = model.embed_tokens.weight.device
    num, length = clean.shape
    known &= ~past_eos(clean, prefixes.sampler.spec.eos_id)  # hybrid stops at EOS: no target
    noisy = draft_canvases(clean, model.cfg.vocab_size, generator)
    cache, batch = _decode_rows(model, prefixes, picks, examples)
    soft: list[torch.Tensor | None] = [None] * num
    hidden = model(noisy.reshape(-1).to(device), soft, batch, cache).view(num, length, -1)
    weights = draft_weights(length, cfg.draft_decay)
    width = int((weights > 0).sum())  # positions 1..width carry weight
    cols = slice(1, 1 + width)
    logits = train_logits(model, hidden[:, cols].reshape(num * width, -1))  # [B * K, V]
    targets = clean[:, cols].to(device)
    ce = F.cross_entropy(logits, targets.reshape(-1), reduction="none").view(num, width)
    w = (weights[cols][None] * known[:, cols]).to(device)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-12)
    with torch.no_grad():
        correct = (logits.argmax(-1).view(num, width) == targets) & known[:, cols].to(device)
        accepted = float(accepted_prefix(correct).float().mean())
    return loss, accepted


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
    draft: bool = False,
) -> StepMetrics:
    """One optimizer step on `picks`: the draft regime's loss when `draft`, else the
    diffusion objective."""
    start = time.perf_counter()
    accepted = None
    if draft:
        loss, accepted = draft_losses(model, prefixes, picks, cfg, generator)
        noise_level, self_cond = 1.0, False
    else:
        loss, noise_level, self_cond = adapter_losses(model, prefixes, picks, cfg, temps, generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    value = loss.item()
    seconds = time.perf_counter() - start
    return StepMetrics(step, value, value, 0.0, noise_level, self_cond, seconds, accepted)


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


def draft_sampler(
    sequences: list[TrainSequence], spec: DataSpec
) -> tuple[ExampleSampler, list[int]]:
    """The draft regime's sampler (a canvas at every position of every sequence) and the
    indices of its pairs that start at one of the sequence's own starts (canvas boundaries:
    what the diffusion objective trains on)."""
    kept = [(seq, every) for seq in sequences if (every := every_position(seq)) is not None]
    if not kept:
        raise ValueError("the training data yields no draft examples")
    sampler = ExampleSampler([every for _, every in kept], spec)
    own = [set(seq.starts) for seq, _ in kept]
    boundary = [i for i, (seq, start) in enumerate(sampler.pairs) if start in own[seq]]
    return sampler, boundary


def run_training(cfg: TrainConfig) -> Path:
    """The training `cfg` describes: the decoder adapter (`cfg.adapter`: returns OUT/adapter)
    or the whole decoder (`engine.adapt.train.train`: returns OUT/final)."""
    return train_adapter(cfg) if cfg.adapter else train(cfg)


def train_adapter(cfg: TrainConfig) -> Path:
    """Run `cfg` (with `cfg.adapter`); returns OUT/adapter."""
    started = time.monotonic()  # `max_seconds` counts the load and the distillation too
    deadline = started + cfg.max_seconds if cfg.max_seconds else None
    resume_from = prepare_out(cfg)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    checkpoint = open_for_training(cfg, cfg.model_dir)  # the bare source
    model, defaults = checkpoint.model, checkpoint.defaults
    spec = data_spec(cfg, checkpoint)
    if spec.canvas_length != model.config.canvas_length:
        raise ValueError(
            f"--canvas-length {spec.canvas_length}: an adapter trains for the checkpoint's "
            f"canvas length ({model.config.canvas_length})"
        )
    # Distilled with the bare source (before the adapter is attached; AR mode is unaffected).
    distill_deadline = started + cfg.max_seconds / 2 if cfg.max_seconds else None
    sequences = load_sequences(cfg, checkpoint, spec, distill_deadline)
    if cfg.draft_regime:
        sampler, boundary = draft_sampler(sequences, spec)
    else:
        sampler, boundary = ExampleSampler(sequences, spec), []
    logger.info("Training an adapter on %d examples", len(sampler.pairs))
    if resume_from is not None:
        load_adapter(model, resume_from / ADAPTER_OUT)
    elif cfg.init_adapter is not None:
        load_adapter(model, cfg.init_adapter)
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
            standard = cfg.standard_every > 0 and step % cfg.standard_every == 0
            draft = cfg.draft_regime and not standard
            picks = sampler.draw(cfg.batch_size, generator)
            if cfg.draft_regime and standard:  # the diffusion objective at canvas boundaries
                picks = [boundary[i % len(boundary)] for i in picks]
            metrics = adapter_step(
                model, optimizer, params, prefixes, picks, cfg, temps, generator, step, draft
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
