"""Warm-up before ready (`engine.device.warmup`): one step of every row kind at each step size,
and nothing left behind that a request or a metric would see."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from engine.device import warmup
from engine.device.warmup import step_buckets, wants_warmup, warm_up
from engine.engine import EngineConfig
from engine.inputs.images import expand_image_tokens
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.rows import ROW_KINDS
from engine.scheduler import SchedulerConfig
from tests.media import encode, noise_image


def tiny_llm(tiny_checkpoint, **config) -> LLM:
    scheduler = SchedulerConfig(max_num_seqs=2)
    return LLM.from_pretrained(
        tiny_checkpoint("c16"), config=EngineConfig(scheduler=scheduler, **config)
    )


def assert_clean(llm: LLM) -> None:
    """No request, page, cached prefix, sampler slot or scheduler history left."""
    engine, sched = llm.engine, llm.engine.scheduler
    assert not engine.requests
    assert engine.pages.usage() == 0.0
    assert engine.pages.cache_usage() == 0.0
    assert sched.slots.num_free == sched.config.max_num_seqs
    assert sched.num_queried_tokens == sched.num_cached_tokens == 0
    assert sched.step_cost.fit() is None and sched.accept_prior is None
    sched.check()


def test_warm_up_runs_every_row_kind_at_each_step_size(tiny_checkpoint, caplog):
    llm = tiny_llm(tiny_checkpoint)
    assert step_buckets(llm.engine) == (1, 2)  # one request per mode, and a full step of two
    with caplog.at_level(logging.INFO, logger="engine.device.warmup"):
        report = warm_up(llm.engine)
    for bucket in (1, 2):
        ran = {kind for size, kind in report.rows if size == bucket}
        assert ran == set(ROW_KINDS), f"{bucket} per mode ran {sorted(ran)}"
    assert report.rows[(2, "denoise")] >= 2 * report.steps[(2, "denoise")] - 1  # full steps
    assert report.num_failed == 0
    lines = [r.getMessage() for r in caplog.records]
    assert sum("rows in" in line for line in lines) == len(report.rows)  # a line per size, kind
    assert "done in" in lines[-1] and "none ran" not in lines[-1]
    assert_clean(llm)


def test_after_warm_up_a_request_gives_the_tokens_of_a_fresh_engine(tiny_checkpoint):
    """No sampler state, cached prefix or learned policy changes what a request draws."""
    params = [
        SamplingParams(max_tokens=20, seed=7, mode=mode, temperature=1.0)
        for mode in (DecodeMode.DIFFUSION, DecodeMode.HYBRID)
    ]
    prompts = [[5, 6, 7, 8], [5, 6, 7, 9]]
    fresh = tiny_llm(tiny_checkpoint).generate(prompts, params)
    warmed = tiny_llm(tiny_checkpoint)
    warm_up(warmed.engine)
    after = warmed.generate(prompts, params)
    assert [o.output_ids for o in after] == [o.output_ids for o in fresh]
    assert len(set(fresh[0].output_ids)) > 1  # sampled (seed-dependent), not one repeated token


def test_on_a_vision_checkpoint_the_warm_up_sends_an_image_and_a_json_schema(
    vision_checkpoint, monkeypatch, caplog
):
    """The checkpoint's processor prepares the warm-up's picture: at each size the vision tower
    runs (counted) and a prefill carries the image's span (the attention variant the first
    image request would otherwise compile); a JSON-schema request runs per mode. Afterwards no
    image is cached (nor a request, page or prefix), and an image request draws the tokens of
    an engine that never warmed up."""
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2))
    fresh = LLM.from_pretrained(vision_checkpoint, config=config)
    processor = fresh.engine.image_processor
    assert processor is not None  # threaded from the checkpoint (`engine.build`)
    image = processor.prepare(encode(noise_image(50, 90)), "image")
    prompts = [
        expand_image_tokens(
            [5, 6, processor.vision.image_token_id, 7, last], [image], processor.vision
        )
        for last in (8, 9)
    ]
    params = [
        SamplingParams(max_tokens=20, seed=7, mode=mode, temperature=1.0)
        for mode in (DecodeMode.DIFFUSION, DecodeMode.HYBRID)
    ]
    want = fresh.generate(prompts, params, images=[[image]] * 2)

    warmed = LLM.from_pretrained(vision_checkpoint, config=config)
    engine, tower = warmed.engine, warmed.engine.model.vision
    towers, spans = [], []
    monkeypatch.setattr(
        tower, "forward", lambda *a: towers.append(1) or type(tower).forward(tower, *a)
    )
    execute = engine.runner.execute
    monkeypatch.setattr(
        engine.runner,
        "execute",
        lambda step: spans.extend(e.spans for e in step.encode if e.spans) or execute(step),
    )
    with caplog.at_level(logging.INFO, logger="engine.device.warmup"):
        report = warm_up(engine)
    assert report.num_images == 2 and len(towers) == 2 and len(spans) == 2  # sizes 1 and 2
    assert report.num_structured == 3 and report.num_failed == 0
    assert report.kinds() == set(ROW_KINDS)
    assert "warm-up: an image of" in caplog.text
    assert len(engine.runner.vision) == 0
    assert_clean(warmed)
    monkeypatch.undo()
    after = warmed.generate(prompts, params, images=[[image]] * 2)
    assert [o.output_ids for o in after] == [o.output_ids for o in want]

    # Built from a bare model: no processor, no tokenizer, so neither an image nor a schema.
    bare = LLM(warmed.model, None, warmed.defaults, config)
    with caplog.at_level(logging.INFO, logger="engine.device.warmup"):
        report = warm_up(bare.engine)
    assert report.num_images == report.num_structured == 0 and report.num_failed == 0
    assert report.kinds() == set(ROW_KINDS)
    assert "no image (the engine has no image processor)" in caplog.text


def test_a_failing_warm_up_is_logged_and_leaves_the_engine_clean(
    tiny_checkpoint, monkeypatch, caplog
):
    llm = tiny_llm(tiny_checkpoint)
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device fault")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with caplog.at_level(logging.INFO, logger="engine.device.warmup"):
        report = warm_up(llm.engine)
    assert report.num_steps == 1
    assert "warm-up failed" in caplog.text
    assert_clean(llm)


def test_a_stop_ends_the_warm_up_between_steps(tiny_checkpoint):
    llm = tiny_llm(tiny_checkpoint)
    asked = []
    report = warm_up(llm.engine, should_stop=lambda: len(asked.append(1) or asked) > 3)
    assert 0 < report.num_steps < 4
    assert_clean(llm)


def fake_engine(backend: str = "triton", warmup: bool | None = None, **scheduler) -> object:
    """What `wants_warmup` and `step_buckets` read of an engine."""
    return SimpleNamespace(
        config=SimpleNamespace(warmup=warmup),
        model=SimpleNamespace(kernels=SimpleNamespace(backend=backend)),
        scheduler=SimpleNamespace(config=SchedulerConfig(**scheduler)),
        canvas_length=256,
    )


def test_warm_up_is_on_where_kernels_compile_at_first_use(tiny_checkpoint, monkeypatch):
    assert not wants_warmup(tiny_llm(tiny_checkpoint).engine)  # CPU kernels build at load
    monkeypatch.setattr(warmup, "interpreting", lambda: False)
    assert wants_warmup(fake_engine("triton"))
    assert not wants_warmup(fake_engine("triton", warmup=False))  # --no-warmup
    assert not wants_warmup(fake_engine("native"))
    assert wants_warmup(fake_engine("native", warmup=True))
    monkeypatch.setattr(warmup, "interpreting", lambda: True)  # the interpreter compiles nothing
    assert not wants_warmup(fake_engine("triton"))


def test_triton_cache_dir_is_under_canvas_cache_unless_the_user_set_one(monkeypatch, tmp_path):
    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path / "canvas"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert warmup.triton_cache_dir() == tmp_path / "canvas" / "triton"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "canvas" / "triton")  # for Triton
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert warmup.triton_cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        ({}, (1, 32)),  # 64 sequences, but a step of 8,192 tokens holds 32 canvases
        ({"max_num_seqs": 8}, (1, 8)),
        ({"max_num_seqs": 1}, (1,)),
        ({"max_num_batched_tokens": 100}, (1,)),  # less than a canvas: one at a time
    ],
)
def test_the_largest_step_size_is_what_one_step_runs(scheduler, expected):
    assert step_buckets(fake_engine(**scheduler)) == expected
