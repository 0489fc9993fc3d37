"""`canvas train`: the denoising loss falls on easy data, resume continues exactly where a
checkpoint left off, the result loads, self-distillation trains on the model's AR completions."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.adapt.train_data import (
    DataSpec,
    ExampleSampler,
    chat_sequence,
    encode_prompt,
    read_prompts,
    text_windows,
)
from server.cli import main

EASY_TEXT = "the cat sat on the mat. " * 80


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: a second thread only adds synchronisation (and contention on CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def easy_text(tmp_path: Path) -> Path:
    path = tmp_path / "easy.txt"
    path.write_text(EASY_TEXT)
    return path


def run_train(model: Path, out: Path, *args: str) -> int:
    return main(["train", "--model", str(model), "--out", str(out), "--no-progress", *args])


def text_args(data: Path, *args: str) -> list[str]:
    return [
        "--data",
        str(data),
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--context-length",
        "16",
        *args,
    ]


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "loss_log.jsonl").read_text().splitlines()]


def test_training_lowers_the_denoising_loss_and_writes_a_loadable_model(
    tiny_checkpoint, easy_text, tmp_path
):
    out = tmp_path / "run"
    args = text_args(easy_text, "--steps", "50", "--canvas-length", "8", "--save-every", "25")
    assert run_train(tiny_checkpoint("c16"), out, *args) == 0
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, 51))
    assert set(log[0]) >= {"step", "loss", "denoise_loss", "ar_loss", "noise_level", "seconds"}
    first = statistics.mean(r["denoise_loss"] for r in log[:10])
    last = statistics.mean(r["denoise_loss"] for r in log[-10:])
    assert last < 0.7 * first, (first, last)
    assert statistics.mean(r["ar_loss"] for r in log[-10:]) < statistics.mean(
        r["ar_loss"] for r in log[:10]
    )
    assert (out / "checkpoint-25" / "trainer_state.pt").is_file()
    assert json.loads((out / "final" / "config.json").read_text())["canvas_length"] == 8
    llm = LLM.from_pretrained(out / "final")
    (result,) = llm.generate("the cat", SamplingParams(max_tokens=12, seed=0, ignore_eos=True))
    assert llm.canvas_length == 8
    assert len(result.output_ids) == 12 and len(result.steps_per_canvas) == 2


def test_resume_continues_exactly_where_the_checkpoint_left_off(
    tiny_checkpoint, easy_text, tmp_path
):
    model = tiny_checkpoint("c16")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert (
        run_train(model, straight, *text_args(easy_text, "--steps", "6", "--save-every", "3")) == 0
    )
    assert run_train(model, resumed, *text_args(easy_text, "--steps", "3")) == 0
    assert run_train(model, resumed, *text_args(easy_text, "--steps", "6", "--resume")) == 0

    def losses(out: Path) -> list[tuple[int, float, float, bool]]:
        return [(r["step"], r["loss"], r["noise_level"], r["self_cond"]) for r in read_log(out)]

    # Equal losses after the resume need the weights, the AdamW moments and the data/noise
    # generator of step 3 all restored exactly.
    assert [s for s, *_ in losses(resumed)] == [1, 2, 3, 4, 5, 6]
    assert losses(resumed) == losses(straight)
    state = torch.load(resumed / "checkpoint-6" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6 and state["optimizer"]["state"]
    (out,) = LLM.from_pretrained(resumed / "final").generate([5, 6, 7], SamplingParams(seed=1))
    assert out.output_ids


def test_train_refuses_to_overwrite_or_to_resume_from_nothing(
    tiny_checkpoint, easy_text, tmp_path, capsys
):
    model, out = tiny_checkpoint("c16"), tmp_path / "run"
    assert run_train(model, out, *text_args(easy_text, "--steps", "1", "--resume")) == 2
    assert "no checkpoint-* to resume from" in capsys.readouterr().err
    assert run_train(model, out, *text_args(easy_text, "--steps", "1")) == 0
    assert run_train(model, out, *text_args(easy_text, "--steps", "2")) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_whole_decoder_training_refuses_an_adapter_config(tmp_path):
    from engine.adapt.train import TrainConfig, train

    cfg = TrainConfig(
        model_dir=tmp_path / "model", out_dir=tmp_path / "run", self_distill=True, adapter=True
    )
    with pytest.raises(ValueError, match="run_training"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_self_distill_trains_on_the_models_own_ar_completions(tiny_checkpoint, tmp_path):
    model, out = tiny_checkpoint("c16"), tmp_path / "run"
    args = ["--self-distill", "--distill-max-tokens", "4", "--steps", "2", "--batch-size", "2"]
    assert run_train(model, out, *args) == 0
    records = [json.loads(line) for line in (out / "distill_data.jsonl").read_text().splitlines()]
    prompts = read_prompts()
    assert len(records) == len(prompts) >= 25
    llm = LLM.from_pretrained(model)
    first = encode_prompt(llm.tokenizer, prompts[0])
    (expected,) = llm.generate(first, SamplingParams(max_tokens=4, mode=DecodeMode.AR, seed=0))
    assert records[0]["prompt_ids"] == first
    assert records[0]["completion_ids"] == expected.output_ids
    assert len(read_log(out)) == 2


def test_text_windows_put_bos_and_the_context_before_each_canvas():
    spec = DataSpec(canvas_length=4, context_length=3, eos_id=1, bos_id=2)
    windows = text_windows(list(range(10, 23)), spec)  # 13 tokens: two windows of 2 + 4
    assert [w.ids for w in windows] == [(2, 10, 11, 12, 13, 14, 15), (2, 16, 17, 18, 19, 20, 21)]
    assert all(w.starts == (3,) for w in windows)
    example = ExampleSampler(windows, spec).example(1)
    assert example.context == (2, 16, 17) and example.canvas == (18, 19, 20, 21)


def test_completion_canvases_start_at_canvas_boundaries_and_fill_with_eos():
    spec = DataSpec(canvas_length=4, context_length=64, eos_id=1, bos_id=2)
    finished = chat_sequence([2, 50, 51], [60, 61, 62, 63, 64], spec)
    assert finished is not None and finished.starts == (3, 7)
    sampler = ExampleSampler([finished], spec)
    assert sampler.example(1).canvas == (64, 1, 1, 1) and sampler.example(1).num_known == 4
    cut = chat_sequence([2, 50, 51], [60, 61, 62, 63, 64], spec, finished=False)
    assert cut is not None
    tail = ExampleSampler([cut], spec).example(1)
    assert tail.canvas[0] == 64 and tail.num_known == 1  # nothing is known past a cut
