"""`make gpu-train` inside its device call: distillation stops at its deadline, and the run's
outputs reach --out while it runs (what a killed run brings back)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine.adapt import gpu_train
from engine.adapt.train_data import DISTILL_CHUNK, read_prompts, self_distill


@dataclass
class FakeOutput:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str = "stop"


class FakeTokenizer:
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return [len(messages[0]["content"])]


class FakeLLM:
    """Answers each prompt with one token; every `generate` call takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.tokenizer, self.seconds, self.calls = FakeTokenizer(), seconds, []

    def generate(self, prompts: list[list[int]], params: list[object]) -> list[FakeOutput]:
        self.calls.append(len(prompts))
        time.sleep(self.seconds)
        return [FakeOutput(p, [7]) for p in prompts]


def test_distillation_starts_no_chunk_after_its_deadline() -> None:
    extra = [f"question {i}" for i in range(3 * DISTILL_CHUNK)]
    llm = FakeLLM(seconds=0.2)
    records = self_distill(llm, 4, 0.0, 0, extra_prompts=extra, deadline=time.monotonic() + 0.3)
    assert llm.calls == [DISTILL_CHUNK, DISTILL_CHUNK]  # the second started before 0.3 s
    assert len(records) == 2 * DISTILL_CHUNK
    assert records[0]["prompt_ids"] == [len(read_prompts()[0])]  # shipped prompts first


def test_distillation_without_a_deadline_is_one_call() -> None:
    llm = FakeLLM(seconds=0.0)
    records = self_distill(llm, 4, 0.0, 0, extra_prompts=["a", "b"])
    assert llm.calls == [len(read_prompts()) + 2] and len(records) == llm.calls[0]


def save_checkpoint(run: Path, step: int) -> None:
    adapter = run / f"checkpoint-{step}" / "adapter"
    adapter.mkdir(parents=True)
    for name in gpu_train.ADAPTER_FILES:
        (adapter / name).write_text(f"{name} at {step}")


def test_mirror_copies_the_newest_checkpoint_and_the_loss_log_while_training(
    tmp_path: Path,
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    with gpu_train.Mirror(run, out, every_s=0.02) as mirror:
        mirror.stage = "distilling and training"
        (run / "loss_log.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        for step in (100, 900, 1000):  # newest by number, not by name
            save_checkpoint(run, step)
        deadline = time.monotonic() + 5
        while not (out / gpu_train.LORA_FILE).is_file() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        lora = (out / gpu_train.LORA_FILE).read_text()
        summary = json.loads((out / "summary.json").read_text())
    assert lora == f"{gpu_train.LORA_FILE} at 1000"  # copied before the mirror stopped
    assert summary == {"stage": "distilling and training", "steps": 2, "adapter": "checkpoint-1000"}
    assert (out / "loss_log.jsonl").read_text() == (run / "loss_log.jsonl").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*gpu_train.ADAPTER_FILES, "loss_log.jsonl", "summary.json"]
    )
