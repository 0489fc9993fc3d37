"""FP8 weights without a checkpoint: the per-channel quantizer, the compressed-tensors layouts
Canvas reads or refuses (`engine.model.quant`), and the memory plan's FP8 bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG
from engine.device.memory import GB, Fp8Paths, meta_model, model_shapes
from engine.model.config import CheckpointError, ModelConfig, parse_text_config
from engine.model.per_expert import find_stacks
from engine.model.quant import FP8, Fp8Layout, fp8_candidates, parse_layout, quantize_fp8
from kernels.reference import dequantize_fp8
from server.cli import main


def test_quantize_fp8_scales_each_output_channel_by_its_amax():
    weight = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    weight[1, 2] = 0  # an all-zero channel stays zero
    q, scale = quantize_fp8(weight)
    assert q.dtype == FP8 and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 5, 1)
    amax = weight.float().abs().amax(-1, keepdim=True)
    nonzero = amax[..., 0] > 0
    assert torch.equal(
        q.float().abs().amax(-1)[nonzero], torch.full_like(amax[..., 0], 448)[nonzero]
    )
    assert torch.equal(q[1, 2].float(), torch.zeros(64))
    back = dequantize_fp8(q, scale, torch.float32)
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value, or of 2^-6 near zero
    bound = 2**-4 * back.abs().clamp(min=2**-6 * scale) + 1e-12
    assert ((back - weight.float()).abs() <= bound).all()
    assert weight.dtype == torch.bfloat16  # the input is left as it was


def group(**changes: object) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    weights["dynamic"] = False
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    activations |= {"symmetric": True}
    g = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    for path, value in changes.items():
        part, key = path.split("__")
        g[part][key] = value
    return g


def layout(**top: object) -> dict:
    raw = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group()},
        "ignore": ["lm_head", "re:.*router.*"],
    }
    return raw | top


def test_the_fp8_dynamic_layout_is_read_with_its_ignore_list():
    parsed = parse_layout(layout())
    assert parsed.ignore == ("lm_head", "re:.*router.*")
    assert parsed.ignores("model.decoder.layers.3.router.proj")
    assert parsed.ignores("lm_head") and not parsed.ignores("model.decoder.layers.3.mlp.up_proj")
    assert parse_layout(Fp8Layout().as_config()) == Fp8Layout()  # what convert writes


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (layout(quant_method="gptq"), "quant_method 'gptq' is not supported"),
        (layout(format="pack-quantized"), "format 'pack-quantized' is not supported"),
        (
            layout(config_groups={"g": group(weights__strategy="block")}),
            "config_groups.g.weights.strategy 'block' is not supported",
        ),
        (
            layout(config_groups={"g": group(weights__type="int", weights__num_bits=4)}),
            "weights.num_bits 4 is not supported",
        ),
        (
            layout(config_groups={"g": group(input_activations__dynamic=False)}),
            "static activation scales",
        ),
        (layout(kv_cache_scheme={"num_bits": 8}), "FP8 KV cache scales are not supported"),
        (layout(sparsity_config={"format": "sparse-24"}), "sparse weights are not supported"),
        (layout(ignore=["re:(unclosed"]), "is not a regex"),
    ],
)
def test_other_quantization_layouts_are_refused_naming_what_is_unsupported(raw, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_layout(raw)


def real_config() -> ModelConfig:
    return ModelConfig(
        "diffusion_gemma", parse_text_config(dict(REAL_26B_A4B_TEXT_CONFIG)), 256, "bfloat16"
    )


def test_canvas_plan_counts_fp8_weights_and_their_scales(capsys):
    model = meta_model(real_config(), torch.bfloat16)
    params = dict(model.named_parameters())
    fp8 = [params[n] for names in fp8_candidates(model).values() for n in names]
    bf16_bytes = sum(t.numel() * t.element_size() for t in [*params.values(), *model.buffers()])
    # each FP8 weight: 1 byte instead of 2, plus an fp32 scale per output channel
    saved = sum(p.numel() - 4 * math.prod(p.shape[:-1]) for p in fp8)
    args = ["--preset", "real-26b-a4b", "--gpu", "h100", "--max-model-len", "8192", "--json"]
    assert main(["plan", *args, "--quantization", "fp8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_bytes"] == bf16_bytes - saved
    # The goal: the real shapes in <= 27 GB of FP8 weights, >= 32 running canvases on one H100.
    assert plan["weights_bytes"] <= 27 * GB
    assert plan["max_running_requests"] >= 32


def test_the_plan_holds_room_for_what_each_devices_fp8_kernels_allocate():
    """Dequantizing kernels (the twins, sm_80) hold a call's weights in bf16 (the experts' two
    at once) beside the fp32 product of the larger; sm_89 dequantizes only the projections
    (one weight at a time); sm_90's `_scaled_mm` holds each token's FP8 copy of a projection's
    input (the widest: o_proj's 16 heads of 512) and its fp32 scale, its experts nothing."""
    model = meta_model(real_config(), torch.bfloat16, "fp8")
    bf16 = model_shapes(meta_model(real_config(), torch.bfloat16), fp8=Fp8Paths())
    assert bf16.dequant_bytes == 0 and model_shapes(model).token_bytes == bf16.token_bytes
    gate_up = 128 * 2 * 704 * 2816
    twins = model_shapes(model)  # a model on the meta device with no kernels bound: the twins
    assert twins.dequant_bytes == 2 * (gate_up + gate_up // 2) + 4 * gate_up
    assert model_shapes(model, fp8=Fp8Paths.bound("triton", (8, 0))) == twins
    assert model_shapes(model, fp8=Fp8Paths.bound("twins", (9, 0))) == twins
    sm89 = model_shapes(model, fp8=Fp8Paths.bound("triton", (8, 9)))
    assert sm89.dequant_bytes == 2816 * 16 * 512 * (2 + 4)  # the largest projection: o_proj
    sm90 = model_shapes(model, fp8=Fp8Paths.bound("triton", (9, 0)))
    assert sm90.dequant_bytes == 0 and sm90.token_bytes == bf16.token_bytes + 16 * 512 + 4
    fp32 = meta_model(real_config(), torch.float32, "fp8")  # `_scaled_mm` takes bf16 only
    assert model_shapes(fp32, fp8=Fp8Paths.bound("triton", (9, 0))).dequant_bytes > 0
    # a dense MLP 2,120 wide is not `_scaled_mm`'s (multiples of 16): its calls dequantize
    text = parse_text_config(dict(REAL_26B_A4B_TEXT_CONFIG, intermediate_size=2120))
    odd = meta_model(ModelConfig("diffusion_gemma", text, 256, "bfloat16"), torch.bfloat16, "fp8")
    odd_sm90 = model_shapes(odd, fp8=Fp8Paths.bound("triton", (9, 0)))
    assert odd_sm90.dequant_bytes == 2120 * 2816 * (2 + 4)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)])
def test_the_plans_fp8_paths_are_what_the_triton_backend_binds(monkeypatch, capability):
    from kernels import resolve_kernels, triton_fp8, triton_moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    kernels = resolve_kernels("cuda", "triton")
    paths = Fp8Paths.bound("triton", capability)
    assert paths.scaled_mm == (kernels.fp8_linear is triton_fp8.fp8_linear)
    assert paths.fp8_experts == (kernels.fp8_moe is triton_moe.fp8_moe)


def test_canvas_plan_reserves_dequantized_experts_only_where_they_are_dequantized(capsys):
    args = ["--preset", "real-26b-a4b", "--max-model-len", "8192", "--json"]
    steps = {}
    for gpu in ("a100", "h100"):
        assert main(["plan", *args, "--quantization", "fp8", "--gpu", gpu]) == 0
        steps[gpu] = json.loads(capsys.readouterr().out)["step_bytes"]
    gate_up = 128 * 2 * 704 * 2816
    # the same 32 canvases a step: the A100 adds a layer's dequantized experts (3.55 GB) and
    # leaves out the H100's per-token FP8 copies
    dequantized = 2 * (gate_up + gate_up // 2) + 4 * gate_up
    assert steps["a100"] - steps["h100"] == dequantized - 32 * 256 * (16 * 512 + 4)


def test_canvas_plan_refuses_exact_with_fp8(capsys):
    args = ["--preset", "real-26b-a4b", "--gpu", "h100", "--quantization", "fp8", "--exact"]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert "--exact" in err and "--quantization fp8" in err


def test_per_expert_tensors_stack_gate_then_up_one_part_at_a_time():
    """transformers' fused gate_up_proj holds each expert's gate rows, then its up rows."""
    experts, hidden, inter = 3, 8, 4
    stored = {}
    for e in range(experts):
        for proj, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
            weight = torch.randn(rows, inter if proj == "down_proj" else hidden)
            stored[f"m.experts.{e}.{proj}.weight"], scale = quantize_fp8(weight)
            stored[f"m.experts.{e}.{proj}.weight_scale"] = scale.to(torch.bfloat16)
    stored["m.router.per_expert_scale"] = torch.ones(experts)  # not an expert's tensor

    def meta(key: str) -> tuple[list[int], str]:
        return list(stored[key].shape), {FP8: "F8_E4M3"}.get(stored[key].dtype, "BF16")

    stacks = find_stacks(stored.keys(), meta, experts, Fp8Layout())
    assert sorted(stacks) == [
        "m.experts.down_proj",
        "m.experts.down_proj_scale",
        "m.experts.gate_up_proj",
        "m.experts.gate_up_proj_scale",
    ]
    read: list[str] = []

    def get(key: str) -> torch.Tensor:
        read.append(key)
        return stored[key]

    gate_up = stacks["m.experts.gate_up_proj"].read(get, "cpu")
    assert gate_up.shape == (experts, 2 * inter, hidden) and gate_up.dtype == FP8
    assert read == [
        f"m.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up")
    ]
    for e in range(experts):
        gate, up = gate_up[e].view(torch.uint8).chunk(2)
        assert torch.equal(gate, stored[f"m.experts.{e}.gate_proj.weight"].view(torch.uint8))
        assert torch.equal(up, stored[f"m.experts.{e}.up_proj.weight"].view(torch.uint8))
    scales = stacks["m.experts.down_proj_scale"].read(get, "cpu")
    assert scales.shape == (experts, hidden, 1) and scales.dtype == torch.float32
    assert torch.equal(scales[2], stored["m.experts.2.down_proj.weight_scale"].float())
