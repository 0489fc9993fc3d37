"""`canvas eval`: quality and speed of a checkpoint per decoding mode, on a fixed prompt set.

For each mode, every prompt of `data/eval_prompts.jsonl` (a short factual question, chat-
templated when the checkpoint has a template) is generated in one batch; prompt i uses seed
`seed + i`. Reported per mode:
- tokens per forward: output tokens / passes (decoder passes; encoder passes in AR mode;
  hybrid: decoder and encoder passes, verify passes included), and in hybrid mode the mean
  number of draft tokens accepted per verify pass;
- tokens/s: output tokens / wall-clock seconds of the batch;
- accuracy: fraction of outputs that contain the answer (or one of its aliases),
  case-insensitive;
- mean log-likelihood: the mean, over all output tokens, of log p(token | prompt, earlier output)
  under the source model's encoder (teacher-forced, one causal pass over prompt + output);
  generative perplexity = exp(-mean log-likelihood). The source defaults to the evaluated model.

`quantization` "fp8" quantizes the evaluated model's weights at load (`engine.model.quant`); a
source given apart is loaded as stored, so `--source` naming the same directory scores FP8
outputs under the unquantized weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.adapt.forward import TrainKVCache, train_batch
from engine.build import BuildConfig, CheckpointConfig, open_checkpoint
from engine.engine import EngineConfig
from engine.inputs.tokenizer import Tokenizer
from engine.llm import LLM, RequestOutput
from engine.model import DiffusionLM, Mode
from engine.modes import policy
from engine.params import MODE_NAMES, DecodeMode, SamplingParams
from engine.types import tokens_per_forward

EVAL_PROMPTS = Path(__file__).parent / "data" / "eval_prompts.jsonl"


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    question: str
    answer: str
    aliases: tuple[str, ...] = ()

    def is_answered_by(self, text: str) -> bool:
        text = text.lower()
        return any(a.lower() in text for a in (self.answer, *self.aliases))


@dataclass(frozen=True, slots=True)
class EvalConfig:
    model_dir: Path
    source_dir: Path | None = None  # None: the evaluated model is its own reference
    modes: tuple[DecodeMode, ...] = (DecodeMode.DIFFUSION, DecodeMode.AR)
    max_tokens: int = 64
    limit: int | None = None
    seed: int = 0
    device: str = "auto"  # cuda when available, else cpu
    dtype: str = "auto"
    adapter: str | bool = True  # a decoder adapter directory; True: the model's own; False: none
    # Full-attention KV positions of the engine (None: the engine's default). The pool is
    # allocated up front: at the default 131,072 positions that is 6 GB for SmolLM2 in fp32.
    kv_cache_tokens: int | None = None
    quantization: str = "auto"  # "fp8": the evaluated model's weights quantized at load

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError(f"--modes: name at least one of {', '.join(MODE_NAMES)}")
        if self.max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: str
    num_prompts: int
    num_correct: int
    accuracy: float
    num_output_tokens: int
    decoder_passes: int
    encoder_passes: int
    tokens_per_forward: float
    tokens_per_second: float
    seconds: float
    mean_steps_per_canvas: float  # 0 in AR mode
    mean_loglik: float  # per output token, under the source model (nan: no output tokens)
    generative_perplexity: float


def load_eval_prompts(path: Path = EVAL_PROMPTS, limit: int | None = None) -> list[EvalPrompt]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [EvalPrompt(r["question"], r["answer"], tuple(r.get("aliases", ()))) for r in records]
    return prompts[:limit] if limit is not None else prompts


def question_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    """The question as a chat turn, or as a plain Q/A prompt for a checkpoint without a
    chat template."""
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}])
    except ValueError:
        return tokenizer.encode(f"Question: {question}\nAnswer:")


@torch.inference_mode()
def teacher_forced_log_probs(
    model: DiffusionLM, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """log p(. | prompt, output[:i]) for each output position i: [len(output), V] fp32, from
    one causal encoder pass over prompt + output."""
    device = model.embed_tokens.weight.device
    ids = torch.tensor(prompt_ids + output_ids[:-1], device=device)  # the last token is no input
    batch = train_batch(Mode.ENCODE, [0], [len(ids)], model.cfg.sliding_window)
    hidden = model(ids, [], batch, TrainKVCache())  # [P + T - 1, H]
    return torch.log_softmax(model.logits(hidden[len(prompt_ids) - 1 :]), dim=-1)


def output_logliks(model: DiffusionLM, outputs: list[RequestOutput]) -> list[float]:
    """Log-likelihood of every output token of every output, under `model`."""
    values: list[float] = []
    for out in outputs:
        if out.output_ids:
            log_probs = teacher_forced_log_probs(model, out.prompt_ids, out.output_ids)
            chosen = log_probs.gather(
                1, torch.tensor(out.output_ids, device=log_probs.device)[:, None]
            )
            values += chosen[:, 0].tolist()
    return values


def evaluate_mode(
    llm: LLM, source: DiffusionLM, prompts: list[EvalPrompt], mode: DecodeMode, cfg: EvalConfig
) -> tuple[ModeResult, float]:
    """The mode's result and, for hybrid, the mean number of draft tokens accepted per verify
    pass (0 for the other modes; reported as `mean_accepted` in hybrid results only)."""
    assert llm.tokenizer is not None
    ids = [question_ids(llm.tokenizer, p.question) for p in prompts]
    params = [
        SamplingParams(max_tokens=cfg.max_tokens, mode=mode, seed=cfg.seed + i)
        for i in range(len(prompts))
    ]
    outputs = llm.generate(ids, params)
    seconds = max(o.seconds for o in outputs)  # each output's clock starts with the batch
    num_tokens = sum(len(o.output_ids) for o in outputs)
    steps = [s for o in outputs for s in o.steps_per_canvas]
    verify = sum(o.verify_passes for o in outputs)
    correct = sum(p.is_answered_by(o.text) for p, o in zip(prompts, outputs, strict=True))
    logliks = output_logliks(source, outputs)
    mean_loglik = sum(logliks) / len(logliks) if logliks else math.nan
    return ModeResult(
        mode=mode.value,
        num_prompts=len(prompts),
        num_correct=correct,
        accuracy=correct / len(prompts),
        num_output_tokens=num_tokens,
        decoder_passes=(decoder := sum(o.decoder_passes for o in outputs)),
        encoder_passes=(encoder := sum(o.encoder_passes for o in outputs)),
        tokens_per_forward=tokens_per_forward(num_tokens, decoder, encoder, verify),
        tokens_per_second=num_tokens / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        mean_steps_per_canvas=sum(steps) / len(steps) if steps else 0.0,
        mean_loglik=mean_loglik,
        generative_perplexity=math.exp(min(-mean_loglik, 700.0)),  # no OverflowError
    ), (sum(o.accepted_tokens for o in outputs) / verify if verify else 0.0)


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Run every mode; returns the report as a JSON-ready dict ({"modes": {mode: result}})."""
    engine = (
        None if cfg.kv_cache_tokens is None else EngineConfig(kv_cache_tokens=cfg.kv_cache_tokens)
    )
    checkpoint = CheckpointConfig(
        cfg.model_dir, cfg.dtype, cfg.device, adapter=cfg.adapter, quantization=cfg.quantization
    )
    llm = LLM.from_config(BuildConfig(checkpoint, engine or EngineConfig()))
    if llm.tokenizer is None:
        raise ValueError(
            f"--model {cfg.model_dir}: canvas eval needs a checkpoint with a tokenizer"
        )
    source = llm.model
    if cfg.source_dir is not None:
        source_config = CheckpointConfig(cfg.source_dir, cfg.dtype, cfg.device, adapter=False)
        source = open_checkpoint(source_config).model
        if source.cfg.vocab_size != llm.model.cfg.vocab_size:
            raise ValueError(
                f"--source {cfg.source_dir}: vocab size {source.cfg.vocab_size} differs from the "
                f"model's {llm.model.cfg.vocab_size}; the source must share the tokenizer"
            )
    prompts = load_eval_prompts(limit=cfg.limit)
    results = {}
    for mode in cfg.modes:
        result, accepted = evaluate_mode(llm, source, prompts, mode, cfg)
        results[mode.value] = asdict(result)
        if not policy(mode).commits_drafts():  # its drafts are verified: how much was kept
            results[mode.value]["mean_accepted"] = accepted
    return {
        "model": str(cfg.model_dir),
        "source": str(cfg.source_dir or cfg.model_dir),
        "num_prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "quantization": cfg.quantization,
        "modes": results,
    }


def choose_default_mode(report: dict[str, Any]) -> str:
    """The default decoding mode a report argues for: of the modes at least as accurate as AR,
    the one with the most tokens per second (on the machine the report was measured on); AR
    when none is faster. Needs AR and at least one other mode in the report."""
    modes = report["modes"]
    if "ar" not in modes or len(modes) < 2:
        raise ValueError("--set-default-mode needs --modes diffusion,ar (or ar,hybrid, or all)")
    ar = modes["ar"]
    best = "ar"
    for name, result in modes.items():
        as_good = result["accuracy"] >= ar["accuracy"]
        if as_good and result["tokens_per_second"] > modes[best]["tokens_per_second"]:
            best = name
    return best


def set_default_mode(model_dir: Path, mode: str) -> None:
    """Write `mode` as the checkpoint's default (generation_config.json canvas_default_mode)."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["canvas_default_mode"] = mode
    path.write_text(json.dumps(config, indent=2) + "\n")


COLUMNS = (
    ("mode", "mode", "{}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("tokens", "num_output_tokens", "{}"),
    ("TPF", "tokens_per_forward", "{:.3f}"),
    ("tok/s", "tokens_per_second", "{:.1f}"),
    ("steps/canvas", "mean_steps_per_canvas", "{:.1f}"),
    ("mean loglik", "mean_loglik", "{:.3f}"),
    ("gen ppl", "generative_perplexity", "{:.2f}"),
)


def format_table(report: dict[str, Any]) -> str:
    """The report (as `evaluate` returns it) as a plain-text table, one row per mode."""
    results = list(report["modes"].values())
    rows = [[fmt.format(r[key]) for _, key, fmt in COLUMNS] for r in results]
    header = [name for name, _, _ in COLUMNS]
    if any("mean_accepted" in r for r in results):  # hybrid: draft tokens accepted per verify
        header.append("accepted/verify")
        for row, r in zip(rows, results, strict=True):
            row.append(f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else "-")
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]
    ]
    title = (
        f"canvas eval: {report['model']} ({report['num_prompts']} prompts, max_tokens "
        f"{report['max_tokens']}, seed {report['seed']}, quantization {report['quantization']}; "
        f"loglik under {report['source']})"
    )
    return "\n".join([title, *lines])
