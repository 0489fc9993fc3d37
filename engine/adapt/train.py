"""`canvas train`: stage 1 of turning an AR checkpoint into a block-diffusion model.

Each step draws `batch_size` (context, canvas) examples (`engine.adapt.train_data`) and:
1. encodes the contexts causally (ENCODE rows, KV kept in a functional `TrainKVCache`) and takes
   the next-token cross-entropy over every context position (the AR loss: it keeps the
   encoder's AR ability, which the commit passes and AR mode rely on);
2. corrupts each canvas with uniform noise at its own level t ~ U(0, 1): every position is
   independently replaced by a uniformly random token with probability t (the sampler's noise:
   no mask token);
3. with probability `self_cond_prob`, runs the decoder once without gradients and conditions the
   second pass on the soft embeddings of its logits, scaled by the temperature the sampler uses
   at that noise level (t_min + (t_max - t_min) t);
4. takes the cross-entropy of the decoder's logits against the clean canvas at every position.
loss = denoise + ar_loss_weight * AR, AdamW, gradient clipping.

Output: `OUT/checkpoint-{step}/` every `save_every` steps and at the last step (weights, the
source's config with `canvas_length` and `dtype` updated, generation config and tokenizer files,
`trainer_state.pt`), `OUT/final/` (loadable by `LLM.from_pretrained`), `OUT/loss_log.jsonl`.
`resume` continues from the latest checkpoint: same step numbering, optimizer and RNG state.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.adapt.forward import TrainKVCache, train_batch, train_logits
from engine.adapt.train_data import (
    DataSpec,
    Example,
    ExampleSampler,
    TrainSequence,
    load_data_file,
    self_distill,
)
from engine.build import Checkpoint, CheckpointConfig, open_checkpoint
from engine.model import DiffusionLM, Mode, save_weights

logger = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"checkpoint-(\d+)")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DISTILL_FILE = "distill_data.jsonl"
IGNORE = -100  # cross-entropy target of canvas positions without a known token


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model_dir: Path
    out_dir: Path
    data: Path | None = None
    self_distill: bool = False
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0  # Gemma norm weights are used as is: decay would shrink them to 0
    grad_clip: float = 1.0  # max gradient norm; 0 disables clipping
    seed: int = 0
    save_every: int = 500
    canvas_length: int | None = None  # None: the checkpoint's canvas_length
    context_length: int = 256
    self_cond_prob: float = 0.5
    ar_loss_weight: float = 1.0
    distill_max_tokens: int = 256
    distill_temperature: float = 0.0  # 0 = greedy
    distill_prompts: int = 0  # generated prompts distilled besides the shipped ones
    adapter: bool = False  # train a decoder adapter only (engine.adapt.train_adapter)
    adapter_rank: int = 8
    adapter_shift: bool = True
    # --adapter: start from this trained adapter (fine-tune) instead of a fresh one
    init_adapter: Path | None = None
    # --adapter: train hybrid's drafter (`engine.adapt.train_adapter.draft_losses`): a canvas
    # at every completion position, slot 0 the true token, the rest noise, one step, the loss
    # weighted by `draft_decay` ** (i - 1) at canvas position i >= 1
    draft_regime: bool = False
    draft_decay: float = 0.7
    standard_every: int = 0  # with draft_regime: every Nth step is the diffusion objective
    # --adapter: the run's wall-clock limit, distillation included (it starts no new prompts
    # after half of it); training stops and saves at it; 0 = off
    max_seconds: float = 0.0
    resume: bool = False
    device: str = "auto"  # cuda when available, else cpu
    dtype: str = "float32"
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.data is None) == (not self.self_distill):
            raise ValueError("pass exactly one of --data FILE and --self-distill")
        for name in ("steps", "batch_size", "context_length", "distill_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.canvas_length is not None and self.canvas_length < 1:
            raise ValueError("--canvas-length must be >= 1")
        if self.save_every < 0 or self.lr <= 0 or self.grad_clip < 0:
            raise ValueError("--save-every and --grad-clip must be >= 0 and --lr > 0")
        if not 0.0 <= self.self_cond_prob <= 1.0:
            raise ValueError("--self-cond-prob must be in [0, 1]")
        if self.distill_prompts < 0 or self.adapter_rank < 1 or self.max_seconds < 0:
            raise ValueError(
                "--distill-prompts and --max-seconds must be >= 0 and --adapter-rank >= 1"
            )
        if self.max_seconds and not self.adapter:
            raise ValueError("--max-seconds is for --adapter runs")
        if (self.init_adapter is not None or self.draft_regime) and not self.adapter:
            raise ValueError("--init-adapter and --draft-regime are for --adapter runs")
        if not 0.0 < self.draft_decay <= 1.0 or self.standard_every < 0:
            raise ValueError("--draft-decay must be in (0, 1] and --standard-every >= 0")
        if self.ar_loss_weight < 0 or self.distill_temperature < 0:
            raise ValueError("--ar-loss-weight and --distill-temperature must be >= 0")


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int
    loss: float
    denoise_loss: float
    ar_loss: float
    noise_level: float  # mean t of the batch's canvases
    self_cond: bool
    seconds: float
    # --draft-regime steps: mean number of leading canvas positions 1.. whose argmax is the
    # target (the drafts the verifier would accept, on the training batch)
    accepted: float | None = None


@dataclass(frozen=True, slots=True)
class TemperatureRange:
    """The sampler's temperature schedule ends (generation_config t_min, t_max)."""

    t_min: float
    t_max: float


def own_aligned_memory(model: DiffusionLM) -> None:
    """Move every parameter and buffer into memory from torch's allocator. Tensors read from
    safetensors can start at any 4-byte offset, and CPU kernels' rounding depends on alignment:
    without this, a resumed run would drift from an uninterrupted one in the last ulp."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def corrupt(
    canvas: torch.Tensor, known: torch.Tensor, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform-noise corruption of clean canvases [B, L]: returns (noisy [B, L], t [B]), each
    position replaced by a uniformly random token with probability t ~ U(0, 1) of its row;
    positions that are not `known` ([B, L] bool: no real token there) always."""
    num_rows, length = canvas.shape
    t = torch.rand(num_rows, generator=generator)  # [B]
    replace = torch.rand(num_rows, length, generator=generator) < t[:, None]
    replace |= ~known
    noise = torch.randint(0, vocab_size, (num_rows, length), generator=generator)
    return torch.where(replace, noise, canvas), t


def step_losses(
    model: DiffusionLM,
    examples: list[Example],
    cfg: TrainConfig,
    temps: TemperatureRange,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """(denoise loss, AR loss, mean noise level, self-conditioned?) of one batch, with graphs.
    Random draws (all on the CPU generator, in a fixed order): noise, then the self-cond coin."""
    device = model.embed_tokens.weight.device
    window, num = model.cfg.sliding_window, len(examples)
    clean = torch.tensor([e.canvas for e in examples])  # [B, L]
    length = clean.shape[1]
    known = torch.arange(length)[None] < torch.tensor([e.num_known for e in examples])[:, None]
    noisy, t = corrupt(clean, known, model.cfg.vocab_size, generator)
    self_cond = bool(torch.rand((), generator=generator) < cfg.self_cond_prob)
    cache = TrainKVCache()  # sequence i: example i
    contexts = [len(e.context) for e in examples]
    encode = train_batch(Mode.ENCODE, [0] * num, contexts, window)
    context = torch.tensor([tok for e in examples for tok in e.context], device=device)
    hidden = model(context, [], encode, cache)  # [N, H]
    # Next-token targets: each context shifted by one, its last position predicting canvas[0].
    targets = torch.tensor([tok for e in examples for tok in (*e.context[1:], e.canvas[0])])
    ar_loss = F.cross_entropy(train_logits(model, hidden), targets.to(device))

    batch = train_batch(Mode.DECODE, contexts, [length] * num, window)
    noisy_ids = noisy.reshape(-1).to(device)
    soft: list[torch.Tensor | None] = [None] * num
    if self_cond:
        with torch.no_grad():
            first = train_logits(model, model(noisy_ids, soft, batch, cache)).view(num, length, -1)
            temperature = (temps.t_min + (temps.t_max - temps.t_min) * t).to(device)
            soft = list(model.soft_embed(first / temperature[:, None, None]))
    logits = train_logits(model, model(noisy_ids, soft, batch, cache))  # [B * L, V]
    canvas_targets = torch.where(known, clean, IGNORE).reshape(-1)  # [B * L]
    denoise_loss = F.cross_entropy(logits, canvas_targets.to(device), ignore_index=IGNORE)
    return denoise_loss, ar_loss, float(t.mean()), self_cond


def train_step(
    model: DiffusionLM,
    optimizer: torch.optim.Optimizer,
    examples: list[Example],
    cfg: TrainConfig,
    temps: TemperatureRange,
    generator: torch.Generator,
    step: int,
) -> StepMetrics:
    start = time.perf_counter()
    denoise, ar, noise_level, self_cond = step_losses(model, examples, cfg, temps, generator)
    loss = denoise + cfg.ar_loss_weight * ar
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return StepMetrics(
        step,
        loss.item(),
        denoise.item(),
        ar.item(),
        noise_level,
        self_cond,
        time.perf_counter() - start,
    )


# -- checkpoints ---------------------------------------------------------------------------------


def write_checkpoint_files(
    dest: Path, model: DiffusionLM, source: Path, canvas_length: int
) -> None:
    """Weights plus the source's config (canvas_length and dtype updated), generation config and
    tokenizer files: a directory `load_model` and `LLM.from_pretrained` read."""
    dest.mkdir(parents=True, exist_ok=True)
    save_weights(model, dest / "model.safetensors")
    for path in source.iterdir():
        skip = path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json")
        if path.is_file() and not skip and path.name not in ("config.json", "trainer_state.pt"):
            shutil.copy2(path, dest / path.name)
    config = json.loads((source / "config.json").read_text())
    config["canvas_length"] = canvas_length
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    # The loader rejects tensors whose dtype differs from the declared one.
    config["dtype"] = dtype
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = dtype
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_checkpoint(
    cfg: TrainConfig,
    step: int,
    model: DiffusionLM,
    canvas_length: int,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
) -> Path:
    """Write OUT/checkpoint-{step}/ through a temporary directory, so that `resume` never sees
    a half-written checkpoint."""
    final = cfg.out_dir / f"checkpoint-{step}"
    tmp = cfg.out_dir / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint_files(tmp, model, cfg.model_dir, canvas_length)
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


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint-{step} directory of OUT with the highest step and a trainer state."""
    found = [
        (int(m.group(1)), p)
        for p in out.glob("checkpoint-*")
        if (m := CHECKPOINT.fullmatch(p.name)) and (p / "trainer_state.pt").is_file()
    ]
    return max(found)[1] if found else None


def restore(checkpoint: Path, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> int:
    """Load the optimizer and RNG state of a checkpoint; returns its step."""
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"])


def truncate_log(log: Path, step: int) -> None:
    """Drop log lines past `step` (written after the checkpoint we resume from)."""
    if log.is_file():
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["step"] <= step]
        log.write_text("".join(ln + "\n" for ln in kept))


# -- the run -------------------------------------------------------------------------------------


def open_for_training(cfg: TrainConfig, model_dir: Path) -> Checkpoint:
    """`model_dir` opened to train: on the twins in exact numerics (autograd needs the PyTorch
    ops, the Triton kernels have no backward, and exact resume needs batch-invariant values),
    without an adapter (training attaches its own, or trains the whole model, into which an
    attached adapter would be saved)."""
    return open_checkpoint(
        CheckpointConfig(
            model_dir, cfg.dtype, cfg.device, exact=True, kernels="twins", adapter=False
        )
    )


def load_sequences(
    cfg: TrainConfig,
    checkpoint: Checkpoint,
    spec: DataSpec,
    distill_deadline: float | None = None,
) -> list[TrainSequence]:
    """The training sequences; self-distilled data is generated once and kept in OUT, so that
    a resumed run trains on the same completions (not on those of the half-trained model).
    Distillation starts no new chunk of prompts after `distill_deadline` (`time.monotonic()`)."""
    from engine.llm import LLM

    model, tokenizer = checkpoint.model, checkpoint.tokenizer
    if cfg.data is not None:
        return load_data_file(cfg.data, tokenizer, spec)
    cached = cfg.out_dir / DISTILL_FILE
    if not cached.is_file():
        from engine.adapt.prompts import generated_prompts
        from kernels import resolve_kernels

        # Generated in fast numerics (batched: several times quicker than exact), then back.
        trained = model.kernels
        model.bind_kernels(
            resolve_kernels(model.embed_tokens.weight.device.type, trained.backend, False)
        )
        llm = LLM(model, tokenizer, checkpoint.defaults)
        extra = generated_prompts(cfg.distill_prompts, cfg.seed)
        records = self_distill(
            llm,
            cfg.distill_max_tokens,
            cfg.distill_temperature,
            cfg.seed,
            extra_prompts=extra,
            deadline=distill_deadline,
        )
        del llm  # frees the engine's KV pools before training
        model.bind_kernels(trained)
        cached.write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_data_file(cached, tokenizer, spec)


def data_spec(cfg: TrainConfig, checkpoint: Checkpoint) -> DataSpec:
    """How the training examples are cut from `checkpoint`'s sequences."""
    model = checkpoint.model
    eos = checkpoint.defaults.eos_token_ids or model.cfg.eos_token_ids
    if not eos:
        raise ValueError(f"{cfg.model_dir}: the checkpoint declares no EOS token")
    return DataSpec(
        canvas_length=cfg.canvas_length or model.config.canvas_length,
        context_length=cfg.context_length,
        eos_id=eos[0],
        bos_id=model.cfg.bos_token_id,
    )


def prepare_out(cfg: TrainConfig) -> Path | None:
    """Validate OUT against `resume`; the checkpoint to resume from, if any."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    latest = latest_checkpoint(cfg.out_dir)
    if cfg.resume and latest is None:
        raise ValueError(f"--resume: {cfg.out_dir} has no checkpoint-* to resume from")
    if not cfg.resume and latest is not None:
        raise ValueError(
            f"{cfg.out_dir} already holds {latest.name}; pass --resume or choose another --out"
        )
    return latest


def train(cfg: TrainConfig) -> Path:
    """Train the whole decoder as `cfg` describes; returns OUT/final. An adapter's training
    (`cfg.adapter`) is `engine.adapt.train_adapter.run_training`'s other branch."""
    if cfg.adapter:
        raise ValueError("cfg.adapter trains an adapter: call train_adapter.run_training(cfg)")
    resume_from = prepare_out(cfg)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    # The whole model trains: from the checkpoint resumed, else from the source.
    checkpoint = open_for_training(cfg, resume_from or cfg.model_dir)
    model, defaults = checkpoint.model, checkpoint.defaults
    spec = data_spec(cfg, checkpoint)
    sampler = ExampleSampler(load_sequences(cfg, checkpoint, spec), spec)
    logger.info("Training on %d examples, canvas length %d", len(sampler.pairs), spec.canvas_length)
    own_aligned_memory(model)
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    log = cfg.out_dir / "loss_log.jsonl"
    step = 0
    if resume_from is not None:
        step = restore(resume_from, optimizer, generator)
        logger.info("Resuming from %s (step %d)", resume_from, step)
    truncate_log(log, step)
    temps = TemperatureRange(defaults.t_min, defaults.t_max)
    bar = tqdm(total=cfg.steps, initial=step, desc="canvas train", disable=not cfg.progress)
    with log.open("a") as log_file:
        while step < cfg.steps:
            step += 1
            examples = sampler.sample(cfg.batch_size, generator)
            metrics = train_step(model, optimizer, examples, cfg, temps, generator, step)
            log_file.write(json.dumps(asdict(metrics)) + "\n")
            log_file.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.loss:.3f}", denoise=f"{metrics.denoise_loss:.3f}")
            if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                save_checkpoint(cfg, step, model, spec.canvas_length, optimizer, generator)
    bar.close()
    final = cfg.out_dir / "final"
    shutil.rmtree(final, ignore_errors=True)
    write_checkpoint_files(final, model.eval(), cfg.model_dir, spec.canvas_length)
    logger.info("Wrote %s", final)
    return final
