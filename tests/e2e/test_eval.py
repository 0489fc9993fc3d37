"""`canvas eval`: every field per decoding mode, the table, answer matching, and a teacher-forced
likelihood that agrees with AR decoding."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.adapt.evaluate import EvalPrompt, load_eval_prompts, teacher_forced_log_probs
from server.cli import main

MODE_FIELDS = {
    "mode",
    "num_prompts",
    "num_correct",
    "accuracy",
    "num_output_tokens",
    "decoder_passes",
    "encoder_passes",
    "tokens_per_forward",
    "tokens_per_second",
    "seconds",
    "mean_steps_per_canvas",
    "mean_loglik",
    "generative_perplexity",
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: a second thread only adds synchronisation (and contention on CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eval_json_reports_every_field_for_each_mode(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("c16"))
    args = ["eval", "--model", path, "--source", path, "--limit", "2", "--max-tokens", "8"]
    assert main([*args, "--seed", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_prompts"] == 2 and report["source"] == path and report["seed"] == 3
    assert set(report["modes"]) == {"diffusion", "ar"}
    for name, result in report["modes"].items():
        assert set(result) == MODE_FIELDS and result["mode"] == name
        assert 0.0 <= result["accuracy"] <= 1.0 and result["num_prompts"] == 2
        assert 2 <= result["num_output_tokens"] <= 16
        passes = result["decoder_passes"] if name == "diffusion" else result["encoder_passes"]
        assert result["tokens_per_forward"] == result["num_output_tokens"] / passes
        assert result["mean_loglik"] <= 0.0
        assert result["generative_perplexity"] == pytest.approx(math.exp(-result["mean_loglik"]))
    assert report["modes"]["diffusion"]["mean_steps_per_canvas"] >= 1
    assert report["modes"]["ar"]["decoder_passes"] == 0


def test_eval_prints_a_table_row_per_mode_and_rejects_unknown_modes(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("c16"))
    assert (
        main(["eval", "--model", path, "--limit", "1", "--max-tokens", "4", "--modes", "ar"]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert "TPF" in lines[1] and "gen ppl" in lines[1]
    assert len(lines) == 3 and lines[2].split()[0] == "ar"
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", path, "--modes", "diffusion,beam"])
    assert exit_info.value.code == 2
    assert "unknown mode(s) ['beam']" in capsys.readouterr().err


def test_teacher_forced_log_probs_agree_with_greedy_ar_decoding(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=6, mode=DecodeMode.AR))
    log_probs = teacher_forced_log_probs(llm.model, prompt, out.output_ids)
    assert log_probs.shape == (len(out.output_ids), llm.model.cfg.vocab_size)
    # Greedy AR picks the argmax of exactly these distributions (an off-by-one would not).
    assert log_probs.argmax(dim=-1).tolist() == out.output_ids


def test_answers_match_case_insensitively_with_aliases():
    prompt = EvalPrompt("How many days are there in a week?", "7", ("seven",))
    assert prompt.is_answered_by("There are Seven days.")
    assert prompt.is_answered_by("7 days")
    assert not prompt.is_answered_by("Six.")
    prompts = load_eval_prompts()
    assert len(prompts) >= 20 and len(load_eval_prompts(limit=3)) == 3
    assert EvalPrompt("What is the capital of France?", "Paris") == prompts[0]
