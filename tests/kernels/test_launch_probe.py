"""The launch-cost probe (`loadtest.gpu.launch_probe`) on a CPU: it times every bound kernel
call of a real denoise step, and `roofline --measured-launch` predicts with its figure."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import resolve_kernels
from loadtest.gpu import roofline
from loadtest.gpu.accountant import GPUS
from loadtest.gpu.bench import model_config
from loadtest.gpu.launch_probe import kernel_names


def test_the_probe_times_each_kernel_call_of_a_step() -> None:
    cost = roofline.measured_launch("twins")
    assert cost.device == "cpu" and "twins" in cost.kernels
    names = set(kernel_names(resolve_kernels("cpu", "twins")))
    assert {"canvas_attention", "sample_and_embed"} <= set(cost.per_kernel_us) <= names
    assert cost.calls >= 3 * len(cost.per_kernel_us)  # every kernel, in each timed round
    assert 0 < cost.per_call_s < max(cost.per_kernel_us.values()) * 1e-6 + 1e-12


def test_a_measured_launch_cost_changes_the_prediction_by_each_launch() -> None:
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    model = roofline.build(model_config(toy=True), kernels, torch.device("meta"))
    step = roofline.account(model, "denoise", 1)
    hw = GPUS[0]
    slower = hw.with_launch(hw.launch_s + 10e-6)
    added = step.acct.seconds(slower) - step.acct.seconds(hw)
    assert added == pytest.approx(step.acct.launches * 10e-6)


def test_the_roofline_prints_and_uses_the_measured_figure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(roofline, "launch_backends", lambda: ("twins",))
    argv = ["--canvases", "1", "--layers", "2", "--kinds", "denoise", "--measured-launch"]
    assert roofline.main([*argv, "--contexts", "64", "128", "--context-canvases", "1"]) == 0
    out = capsys.readouterr().out
    measured = re.search(r"Launch cost measured: ([\d.]+) µs per launcher call on cpu", out)
    assert measured is not None, out
    peaks = re.findall(r"(\d+) µs/launch", out)
    assert peaks and all(abs(int(p) - float(measured.group(1))) <= 1 for p in peaks)
