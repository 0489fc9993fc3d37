"""The engine on a CUDA device, checked without one: `cuda:N` selects GPU N in the loading
thread and the step loop's thread, CUDA errors the context does not survive are told from
out-of-memory, and per-step host inputs are staged in pinned memory only for a GPU."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.device import cuda
from engine.model.loader import load_model


@pytest.fixture
def set_device(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """torch.cuda.set_device recorded as (index, calling thread's name)."""
    calls: list[tuple[int, str]] = []
    record = lambda index: calls.append((index, threading.current_thread().name))  # noqa: E731
    monkeypatch.setattr(torch.cuda, "set_device", record)
    return calls


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cuda:1", [1]), ("cuda:0", [0]), ("cuda", []), ("cpu", []), ("meta", [])],
)
def test_select_device_sets_the_current_gpu_only_for_an_indexed_cuda_device(
    set_device, device, expected
):
    cuda.select_device(device)
    assert [index for index, _ in set_device] == expected


class Loaded(Exception):
    """Stops load_model once it has chosen its device."""


def test_load_model_on_cuda_1_makes_gpu_1_current_before_loading(
    set_device, monkeypatch, tiny_checkpoint
):
    def stop(*_: object) -> None:
        raise Loaded

    monkeypatch.setattr("engine.model.loader.load_model_config", stop)
    with pytest.raises(Loaded):
        load_model(tiny_checkpoint("c16"), device="cuda:1")
    assert set_device == [(1, threading.current_thread().name)]


def test_the_step_loop_thread_makes_its_engines_gpu_current(set_device, monkeypatch):
    config = SimpleNamespace(overlap=False)
    engine = SimpleNamespace(device=torch.device("cuda:1"), limits=None, config=config)
    async_engine = AsyncEngine(engine, warmup=False)  # type: ignore[arg-type]

    def record_then_stop(index: int) -> None:
        set_device.append((index, threading.current_thread().name))
        async_engine._stop.set()  # the loop ends before it asks the engine for work

    monkeypatch.setattr(torch.cuda, "set_device", record_then_stop)
    async_engine.start(None)  # type: ignore[arg-type]
    assert async_engine._thread is not None
    async_engine._thread.join(5)
    assert set_device == [(1, "canvas-step-loop")]


@pytest.mark.parametrize(
    "exc",
    [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"),
        RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    ],
    ids=["AcceleratorError", "device-assert", "launch-failure", "cublas", "triton"],
)
def test_a_cuda_error_is_fatal_even_when_raised_from_another(exc):
    assert cuda.fatal_device_error(exc)
    try:
        raise ValueError("a row failed") from exc
    except ValueError as wrapped:
        assert cuda.fatal_device_error(wrapped)


@pytest.mark.parametrize(
    "exc",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("shape mismatch"),
        ValueError("CUDA error: not a runtime error"),
    ],
    ids=["OutOfMemoryError", "oom-text", "other-runtime", "not-runtime"],
)
def test_out_of_memory_and_other_errors_are_not_fatal(exc):
    assert not cuda.fatal_device_error(exc)


@pytest.mark.parametrize(("device", "pinned"), [("cuda", True), ("cuda:1", True), ("cpu", False)])
def test_host_buffers_are_pinned_exactly_when_the_device_is_cuda(monkeypatch, device, pinned):
    asked: list[bool] = []
    empty = torch.empty

    def recording_empty(*shape: object, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        asked.append(pin_memory)
        return empty(*shape, **kw)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(cuda.torch, "empty", recording_empty)
    buffer = cuda.host_buffer((3, 4), torch.int32, device)
    assert asked == [pinned] and buffer.shape == (3, 4) and buffer.device.type == "cpu"


def test_to_device_stages_through_a_pinned_buffer_for_cuda(monkeypatch):
    staged: list[tuple[tuple[int, ...], torch.dtype, str]] = []
    moved: list[tuple[str, bool]] = []

    def fake_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        staged.append((shape, dtype, str(device)))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(cuda, "host_buffer", fake_buffer)
    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        moved.append((str(args[0]), bool(kwargs.get("non_blocking"))))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "to", to)
    out = cuda.to_device(np.arange(5, dtype=np.int64), "cuda")
    monkeypatch.setattr(torch.Tensor, "to", original_to)
    assert staged == [((5,), torch.int64, "cuda")] and moved == [("cuda", True)]
    assert out.tolist() == [0, 1, 2, 3, 4]
    on_cpu = cuda.to_device(np.arange(3, dtype=np.int32), torch.device("cpu"))
    assert on_cpu.dtype == torch.int32 and on_cpu.tolist() == [0, 1, 2]
