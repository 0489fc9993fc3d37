"""The roofline of an FP8 step on FP8 rows (sm_90's path): the norms and the GeGLU product emit
the rows, so the only per-token quantizer left is attention's output projection's; the experts
read FP8 activations; `--cuda-graphs` frees the launches of what the engine captures,
`--launch-us` sets (or zeroes) every launch's cost."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kernels import resolve_kernels
from loadtest.gpu import roofline
from loadtest.gpu.accountant import H200
from loadtest.gpu.bench import model_config

META = torch.device("meta")


def fp8_step(fp8_rows: bool, graphs: bool = False, canvases: int = 1) -> roofline.StepAccount:
    kernels = resolve_kernels("cpu", "twins")
    kernels = (kernels.with_fp8_rows() if fp8_rows else kernels).with_custom_ops()
    model = roofline.build(model_config(toy=True), kernels, META, "fp8")
    return roofline.account(model, "denoise", canvases, graphs=graphs)


def test_fp8_rows_leave_one_quantizer_a_layer_and_the_experts_read_fp8_activations() -> None:
    quantizing, rows = fp8_step(False), fp8_step(True)
    calls = [Counter(r.name for r in step.acct.records) for step in (quantizing, rows)]
    num_layers = model_config(toy=True).text.num_layers
    assert calls[1]["canvas.fp8_linear.quantize_rows"] == num_layers  # o_proj's input
    projections = calls[0]["canvas.fp8_linear.scaled_mm"]
    assert calls[0]["canvas.fp8_linear.quantize_rows"] == projections > 3 * num_layers
    assert calls[1]["canvas.fp8_linear_rows.scaled_mm"] == projections - num_layers
    # the FP8-emitting kernels replace the bf16 ones one for one: only the quantizers go
    assert quantizing.acct.launches - rows.acct.launches == projections - num_layers
    gone = ("canvas.rms_norm_pair", "canvas.gated_act", "canvas.fp8_moe.expert_gemms")
    assert [calls[1][name] for name in gone] == [0, 0, 0]

    def total(step: roofline.StepAccount, name: str, field: str) -> float:
        return sum(getattr(r, field) for r in step.acct.records if r.name == name)

    bf16_in = total(quantizing, "canvas.fp8_moe.expert_gemms", "bytes")
    fp8_in = total(rows, "canvas.fp8_moe_rows.expert_gemms", "bytes")
    assert fp8_in < bf16_in  # the same weights, FP8 activations
    flops = total(quantizing, "canvas.fp8_moe.expert_gemms", "flops")
    assert total(rows, "canvas.fp8_moe_rows.expert_gemms", "flops") == flops / 2  # FP8's peak
    assert rows.seconds(H200) < quantizing.seconds(H200)


def test_cuda_graphs_free_the_launches_of_what_the_engine_captures_only() -> None:
    """`--cuda-graphs`: the step replays the engine's own graphs (`MetaCapture`): at 1 canvas
    the forward, the head and the sampler's canvas inputs, update and state write run inside
    them (each graph one launch, its kernels none); the same work, the same bytes; at 8
    canvases (above `HEAD_ROWS`) the head and sampler are launched one kernel at a time."""
    eager = fp8_step(True)
    graphed = fp8_step(True, graphs=True)
    free = H200.with_launch(0.0)
    assert graphed.seconds(free) == pytest.approx(eager.seconds(free), rel=1e-3)
    launched = graphed.seconds(H200) - graphed.seconds(free)
    assert launched == pytest.approx(graphed.acct.launches * H200.launch_s)
    replays = [r.phase for r in graphed.acct.records if r.name == "graph.replay"]
    assert replays == ["inputs", "forward", "sampler", "sampler"]
    captured = {r.name for r in graphed.acct.records if r.captured}
    assert {"canvas.softcap", "canvas.fused_sample", "canvas.philox_uniform"} <= captured
    eager_names = {r.name for r in graphed.acct.records if r.host_launches}
    assert eager_names <= {"graph.replay", "copy_", "index_select", "cat"}, eager_names
    assert graphed.acct.launches < eager.acct.launches / 10
    large = fp8_step(True, graphs=True, canvases=8)
    sampled = [r for r in large.acct.records if r.name == "canvas.fused_sample"]
    assert sampled and not any(r.captured for r in sampled)
    assert [r.phase for r in large.acct.records if r.name == "graph.replay"] == ["forward"]


def test_the_launch_cost_flag_sets_every_launch_and_refuses_a_negative_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--canvases", "1", "--layers", "2", "--kinds", "denoise", "--contexts", "2048"]
    args += ["--quantization", "fp8", "--cuda-graphs", "--top", "1"]
    assert roofline.main([*args, "--launch-us", "0"]) == 0
    out = capsys.readouterr().out
    assert "0 µs/launch" in out and "on FP8 rows" in out and "CUDA graphs" in out
    with pytest.raises(SystemExit):
        roofline.main([*args, "--launch-us", "-1"])
    assert "--launch-us must be >= 0" in capsys.readouterr().err
