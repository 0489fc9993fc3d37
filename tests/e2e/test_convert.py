"""`canvas convert`: an AR Llama checkpoint becomes a block-diffusion checkpoint whose encoder
is exactly the source model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.adapt.convert import ConvertOptions, convert
from engine.checkpoints.tiny import build_tokenizer


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny random Llama (tied embeddings, GQA) saved as a safetensors checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=50_000.0,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms so the test sees them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("llama-src")
    model.save_pretrained(path)
    build_tokenizer(512).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    return convert(
        str(source), tmp_path_factory.mktemp("llama-canvas"), ConvertOptions(canvas_length=8)
    )


@torch.inference_mode()
def test_encoder_logits_match_the_source(source, converted):
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(source).eval()
    llm = LLM.from_pretrained(converted, exact=True)
    ids = torch.randint(3, 512, (1, 37), generator=torch.Generator().manual_seed(1))
    want = ref(ids).logits[0]
    engine = llm.engine
    params = llm.defaults.resolve(SamplingParams(max_tokens=1, mode=DecodeMode.AR))
    engine.add_request("x", ids[0].tolist(), params)
    row = engine.scheduler.schedule().rows[0]  # the prefill row over the whole prompt
    pages = engine.scheduler.running["x"].pages
    hidden = engine.runner.model(ids[0], [], _batch(engine, row, pages), engine.runner.cache)
    got = llm.model.logits(hidden)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def _batch(engine, row, pages):
    from engine.model import ForwardBatch, Mode, Row
    from engine.model.config import LayerType

    r = Row(
        Mode.ENCODE,
        row.start,
        row.num_tokens,
        {LayerType.FULL: pages.full, LayerType.SLIDING: pages.sliding()},
    )
    return ForwardBatch([r], engine.model.cfg.sliding_window, engine.runner.cache.page_size)


def test_ar_greedy_output_equals_the_source_greedy_output(source, converted):
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(source).eval()
    llm = LLM.from_pretrained(converted, exact=True)
    for prompt in ([5], [7, 8, 9, 10], list(range(20, 45))):
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        assert out.output_ids == want[0, len(prompt) :].tolist()
        assert out.decoder_passes == 0  # AR is the converted model's default mode


def test_converted_checkpoint_layout_and_diffusion_mode(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "canvas_llama" and config["canvas_length"] == 8
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["canvas_default_mode"] == "ar"
    llm = LLM.from_pretrained(converted, exact=True)
    (out,) = llm.generate(
        [5, 6, 7], SamplingParams(max_tokens=20, seed=0, mode=DecodeMode.DIFFUSION)
    )
    assert len(out.output_ids) <= 20 and out.decoder_passes >= 1


def test_unsupported_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a .gguf file"):
        convert(str(tmp_path / "nothing"), tmp_path / "out")


def test_convert_command_line(source, tmp_path, capsys):
    from server.cli import main

    out = tmp_path / "c"
    args = ["--canvas-length", "16", "--default-mode", "hybrid"]
    assert main(["convert", "--from", str(source), "--to", str(out), *args]) == 0
    assert json.loads((out / "config.json").read_text())["canvas_length"] == 16
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["canvas_default_mode"] == "hybrid"
    (answer,) = LLM.from_pretrained(out, exact=True).generate(
        [5, 6, 7], SamplingParams(max_tokens=4)
    )
    assert answer.verify_passes >= 1  # a request without a mode drafts and verifies
    with pytest.raises(ValueError, match="default_mode must be one of"):
        ConvertOptions(default_mode="speculative")
    assert main(["convert", "--from", str(tmp_path / "missing"), "--to", str(tmp_path / "d")]) == 2
    assert "not a .gguf file" in capsys.readouterr().err


def test_a_converted_checkpoints_tokenizer_loads_without_a_transformers_warning(converted):
    """transformers does not know `canvas_llama`; loading the tokenizer must not warn that the
    checkpoint "can yield errors" (it did on every start of the built-in default model)."""
    import logging

    from transformers import AutoTokenizer

    from engine.inputs.tokenizer import Tokenizer

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        tokenizer = Tokenizer(converted)
        ours = [r.getMessage() for r in records]
        plain = AutoTokenizer.from_pretrained(str(converted))
    finally:
        logger.removeHandler(handler)
    assert ours == []
    assert "can yield errors" in records[-1].getMessage()  # what a plain load says: caught here
    text = "Hello, world! 123"
    assert tokenizer.encode(text) == plain.encode(text)
    assert type(tokenizer.hf) is type(plain)
