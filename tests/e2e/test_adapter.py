"""Decoder adapters: they act on DECODE rows only (ENCODE rows, AR mode and commits stay bit for
bit the source's), round-trip through their files, load from a checkpoint's `adapter/` or a
flag, and `canvas train --adapter` lowers the loss and resumes exactly."""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.adapt.forward import TrainKVCache, train_batch
from engine.model import CheckpointError, DiffusionLM, Mode, load_model
from engine.model.adapter import (
    ADAPTER_SUBDIR,
    LORA_FILE,
    SELF_CONDITIONING_FILE,
    AdapterConfig,
    adapter_parameters,
    attach_adapter,
    load_adapter,
    save_adapter,
)
from server.cli import main


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained_looking(model: DiffusionLM, seed: int = 1) -> None:
    """Give every adapter parameter non-zero values (a fresh adapter is a no-op)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.fixture
def adapter_dir(tiny_checkpoint, tmp_path) -> Path:
    model = load_model(tiny_checkpoint("c16"))
    attach_adapter(model, AdapterConfig(model.config.canvas_length, rank=4))
    trained_looking(model)
    return save_adapter(model, tmp_path / "adapter")


def mixed_forward(model: DiffusionLM) -> torch.Tensor:
    """Hidden states of a batch holding a DECODE row (sequence 0) and an ENCODE row
    (sequence 1) after both prefixes were encoded: [L + 5, H]."""
    cache, window, length = TrainKVCache(), model.cfg.sliding_window, model.config.canvas_length
    ids = torch.arange(3, 3 + 7 + 9)
    model(ids, [], train_batch(Mode.ENCODE, [0, 0], [7, 9], window), cache)
    batch = train_batch(Mode.DECODE, [7], [length], window)
    batch.rows.append(train_batch(Mode.ENCODE, [9], [5], window).rows[0])
    batch.__post_init__()  # offsets of the appended row
    canvas = torch.arange(20, 20 + length)
    return model(torch.cat([canvas, torch.arange(40, 45)]), [None], batch, cache)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_encode_rows_are_bit_identical_with_and_without_the_adapter(
    tiny_checkpoint, adapter_dir, exact
):
    plain = load_model(tiny_checkpoint("c16"), exact=exact, kernels="twins")
    adapted = load_model(tiny_checkpoint("c16"), exact=exact, kernels="twins", adapter=adapter_dir)
    length = plain.config.canvas_length
    with torch.inference_mode():
        without, with_adapter = mixed_forward(plain), mixed_forward(adapted)
    assert torch.equal(without[length:], with_adapter[length:])  # the ENCODE row
    assert (without[:length] - with_adapter[:length]).abs().max() > 1e-3  # the DECODE row


def test_ar_mode_is_token_identical_with_the_adapter(tiny_checkpoint, adapter_dir):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=24, mode=DecodeMode.AR, seed=i) for i in range(2)]
    plain = LLM.from_pretrained(tiny_checkpoint("c16"), adapter=False).generate(prompts, params)
    adapted = LLM.from_pretrained(tiny_checkpoint("c16"), adapter=adapter_dir)
    assert [o.output_ids for o in adapted.generate(prompts, params)] == [
        o.output_ids for o in plain
    ]


def test_adapter_round_trips_through_its_files(tiny_checkpoint, adapter_dir, tmp_path):
    model = load_model(tiny_checkpoint("c16"), adapter=adapter_dir)
    assert model.adapter is not None and model.adapter.config.rank == 4
    again = save_adapter(model, tmp_path / "again")
    for name in (LORA_FILE, SELF_CONDITIONING_FILE):
        assert (again / name).read_bytes() == (adapter_dir / name).read_bytes()
        assert (adapter_dir / name).stat().st_size <= 16 << 20
    params = adapter_parameters(model)
    assert params and all(p.abs().sum() > 0 for p in params)


def test_a_checkpoint_attaches_its_own_adapter_unless_told_not_to(
    tiny_checkpoint, adapter_dir, tmp_path
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("c16"), ckpt)
    assert load_model(ckpt).adapter is None
    shutil.copytree(adapter_dir, ckpt / ADAPTER_SUBDIR)
    assert load_model(ckpt).adapter is not None
    assert load_model(ckpt, adapter=False).adapter is None
    (out,) = LLM.from_pretrained(ckpt).generate([5, 6, 7], SamplingParams(max_tokens=20, seed=0))
    assert len(out.output_ids) == 20 and out.steps_per_canvas


def test_bad_adapters_are_refused_by_name(tiny_checkpoint, adapter_dir, tmp_path):
    model = load_model(tiny_checkpoint("c16"))
    broken = shutil.copytree(adapter_dir, tmp_path / "broken")
    (broken / SELF_CONDITIONING_FILE).unlink()
    with pytest.raises(CheckpointError, match=SELF_CONDITIONING_FILE):
        load_adapter(model, broken)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "rank": 5}))
    shutil.copy(adapter_dir / SELF_CONDITIONING_FILE, broken)
    with pytest.raises(CheckpointError, match="has shape"):
        load_adapter(load_model(tiny_checkpoint("c16")), broken)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tiny_checkpoint("c16"), adapter=tmp_path / "nowhere")


# -- canvas train --adapter ------------------------------------------------------------------


def run_adapter_train(model: Path, out: Path, data: Path, *args: str) -> int:
    return main(
        [
            "train",
            "--model",
            str(model),
            "--out",
            str(out),
            "--data",
            str(data),
            "--adapter",
            "--adapter-rank",
            "4",
            "--batch-size",
            "4",
            "--lr",
            "3e-3",
            "--no-progress",
            *args,
        ]
    )


@pytest.fixture
def easy_text(tmp_path: Path) -> Path:
    path = tmp_path / "easy.jsonl"
    lines = [
        {"prompt_ids": [3, 4, 5 + i % 3], "completion_ids": [40, 41, 42, 43] * 6} for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "loss_log.jsonl").read_text().splitlines()]


def test_adapter_training_lowers_the_loss_and_leaves_the_source_alone(
    tiny_checkpoint, easy_text, tmp_path
):
    model, out = tiny_checkpoint("c16"), tmp_path / "run"
    weights = (model / "model.safetensors").read_bytes()
    assert run_adapter_train(model, out, easy_text, "--steps", "40", "--save-every", "0") == 0
    log = read_log(out)
    first = statistics.mean(r["loss"] for r in log[:8])
    last = statistics.mean(r["loss"] for r in log[-8:])
    assert last < 0.6 * first, (first, last)
    assert (model / "model.safetensors").read_bytes() == weights
    assert load_model(model, adapter=out / "adapter").adapter is not None


def test_adapter_training_resumes_exactly(tiny_checkpoint, easy_text, tmp_path):
    model = tiny_checkpoint("c16")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_adapter_train(model, straight, easy_text, "--steps", "6", "--save-every", "3") == 0
    assert run_adapter_train(model, resumed, easy_text, "--steps", "3") == 0
    assert run_adapter_train(model, resumed, easy_text, "--steps", "6", "--resume") == 0
    assert [r["step"] for r in read_log(resumed)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_log(resumed)] == [r["loss"] for r in read_log(straight)]
    for name in (LORA_FILE, SELF_CONDITIONING_FILE):
        a, b = straight / "adapter" / name, resumed / "adapter" / name
        assert a.read_bytes() == b.read_bytes()


def test_install_adapter_copies_once_and_replaces_a_different_one(adapter_dir, tmp_path):
    from engine.model.adapter import install_adapter

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert install_adapter(adapter_dir, model_dir)
    assert not install_adapter(adapter_dir, model_dir)  # already the same files
    (model_dir / ADAPTER_SUBDIR / LORA_FILE).write_bytes(b"stale")
    assert install_adapter(adapter_dir, model_dir)
    installed = (model_dir / ADAPTER_SUBDIR / LORA_FILE).read_bytes()
    assert installed == (adapter_dir / LORA_FILE).read_bytes()


def test_the_default_mode_is_diffusion_only_when_as_accurate_and_faster(tmp_path):
    from engine.adapt.evaluate import choose_default_mode, set_default_mode

    def report(acc: float, tps: float) -> dict:
        ar = {"accuracy": 0.7, "tokens_per_second": 100.0}
        return {"modes": {"ar": ar, "diffusion": {"accuracy": acc, "tokens_per_second": tps}}}

    assert choose_default_mode(report(0.7, 150.0)) == "diffusion"
    assert choose_default_mode(report(0.6, 150.0)) == "ar"  # faster but less accurate
    assert choose_default_mode(report(0.8, 90.0)) == "ar"  # as accurate but slower
    with pytest.raises(ValueError, match="--modes diffusion,ar"):
        choose_default_mode({"modes": {"ar": {}}})
    (tmp_path / "generation_config.json").write_text('{"t_min": 0.4}')
    set_default_mode(tmp_path, "diffusion")
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"t_min": 0.4, "canvas_default_mode": "diffusion"}


def test_generated_distillation_prompts_are_varied_and_never_the_eval_questions():
    from engine.adapt.prompts import eval_questions, generated_prompts

    prompts = generated_prompts(400, seed=0)
    assert len(prompts) == len(set(prompts)) == 400
    assert not set(generated_prompts(10_000)) & eval_questions()
    assert generated_prompts(50, seed=0) == prompts[:50]
    assert len({p.split()[0] for p in prompts}) >= 8  # many kinds of request, not one template


def test_shift_rotates_each_canvas_by_one_and_leaves_encode_rows_alone():
    from engine.model.adapter import DecoderAdapter

    adapter = DecoderAdapter(AdapterConfig(canvas_length=3), hidden_size=2)
    batch = train_batch(Mode.DECODE, [5, 5], [3, 3], 0)
    batch.rows.insert(1, train_batch(Mode.ENCODE, [0], [2], 0).rows[0])
    batch.__post_init__()
    hidden = torch.arange(16.0).view(8, 2)  # rows: canvas 0..2, encode 3..4, canvas 5..7
    out = adapter.shift(hidden, batch)
    assert out[:, 0].tolist() == [4.0, 0.0, 2.0, 6.0, 8.0, 14.0, 10.0, 12.0]
    plain = DecoderAdapter(AdapterConfig(canvas_length=3, shift=False), hidden_size=2)
    assert torch.equal(plain.shift(hidden, batch), hidden)


# -- the draft regime (hybrid's drafter) -----------------------------------------------------


def test_draft_regime_pieces_match_hybrid_drafting():
    from engine.adapt.train_adapter import (
        accepted_prefix,
        draft_canvases,
        draft_weights,
        past_eos,
    )

    weights = draft_weights(32, 0.5)
    assert weights[0] == 0 and weights[1] == 1 and weights[2] == 0.5 and weights[10] == 0.5**9
    assert (weights[11:] == 0).all()  # 0.5 ** 10 < MIN_DRAFT_WEIGHT: no head there
    clean = torch.arange(2 * 32).view(2, 32) + 100
    noisy = draft_canvases(clean, 50_000, torch.Generator().manual_seed(0))
    assert torch.equal(noisy[:, 0], clean[:, 0])  # slot 0: the pending token
    assert (noisy[:, 1:] != clean[:, 1:]).all()  # the rest: fresh noise
    correct = torch.tensor([[True, True, False, True], [False, True, True, True]])
    assert accepted_prefix(correct).tolist() == [2, 0]
    canvas = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 2]])  # EOS = 2
    assert past_eos(canvas, 2).tolist() == [[False, False, True, True], [False] * 4]


def test_draft_sampler_cuts_a_canvas_at_every_position():
    from engine.adapt.train_adapter import draft_sampler
    from engine.adapt.train_data import DataSpec, chat_sequence

    spec = DataSpec(canvas_length=4, context_length=64, eos_id=2, bos_id=None)
    seq = chat_sequence([7, 8], [20, 21, 22, 23, 24], spec)  # + EOS: 8 ids, boundaries 2, 6
    short = chat_sequence([7], [30], spec, finished=False)  # no position with a next token
    assert seq is not None and seq.starts == (2, 6) and short is not None
    sampler, boundary = draft_sampler([short, seq], spec)
    assert [start for _, start in sampler.pairs] == [2, 3, 4, 5, 6]  # a next token each
    assert [sampler.pairs[i][1] for i in boundary] == [2, 6]
    example = sampler.example(3)
    assert example.context == (7, 8, 20, 21, 22) and example.canvas == (23, 24, 2, 2)


def test_draft_regime_training_logs_acceptance_and_resumes_exactly(
    tiny_checkpoint, easy_text, tmp_path
):
    model = tiny_checkpoint("c16")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ("--draft-regime", "--standard-every", "2")
    assert run_adapter_train(model, straight, easy_text, "--steps", "4", *flags) == 0
    log = read_log(straight)
    assert [r["accepted"] is None for r in log] == [False, True, False, True]
    assert [r["noise_level"] for r in log if r["accepted"] is not None] == [1.0, 1.0]
    # Resumes exactly, from an --init-adapter start (ignored once a checkpoint exists).
    init = straight / "checkpoint-4" / "adapter"
    assert run_adapter_train(model, resumed, easy_text, "--steps", "2", *flags) == 0
    more = ("--steps", "4", "--resume", "--init-adapter", str(init), *flags)
    assert run_adapter_train(model, resumed, easy_text, *more) == 0
    assert [r["loss"] for r in read_log(resumed)] == [r["loss"] for r in log]


def test_init_adapter_starts_from_the_given_weights(
    tiny_checkpoint, adapter_dir, easy_text, tmp_path
):
    model = tiny_checkpoint("c16")
    fresh, tuned = tmp_path / "fresh", tmp_path / "tuned"
    args = ("--steps", "1", "--draft-regime", "--adapter-rank", "4")
    assert run_adapter_train(model, fresh, easy_text, *args) == 0
    assert (
        run_adapter_train(model, tuned, easy_text, *args, "--init-adapter", str(adapter_dir)) == 0
    )
    assert read_log(fresh)[0]["loss"] != read_log(tuned)[0]["loss"]


def test_held_out_prompts_are_never_distilled():
    from engine.adapt.prompts import generated_prompts, held_out_prompts

    held = held_out_prompts(40)
    assert len(set(held)) == 40
    assert not set(held) & set(generated_prompts(441, seed=0))


def test_acceptance_counts_verify_passes_of_a_policy_that_always_drafts(
    tiny_checkpoint, adapter_dir
):
    from engine.adapt.acceptance import hybrid_llm, measure

    llm = hybrid_llm(tiny_checkpoint("c16"), adapter_dir)
    result = measure(llm, [[5, 6, 7], [9, 10, 11, 12]], max_tokens=24)
    assert result.prompts == 2 and result.tokens == 48
    # Every token after the prefill's came out of a verify pass (none from AR steps, which a
    # policy falling back on a random drafter's poor acceptance would take).
    assert result.tokens - result.prompts <= result.verify_passes + result.accepted
    assert result.per_pass == result.accepted / result.verify_passes
