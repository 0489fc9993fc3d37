"""Native CPU canvas attention (`kernels.native.attention`, `native/attention.c`) against the
batched twin: every scenario of `test_attention` at head dims the C kernel takes, a row's bits
in any batch, the split on torch's OpenMP team against our own threads, and the cases that
keep the twin."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import reference
from kernels.native import attention as native_attention
from kernels.native import build
from tests.kernels.attention_cases import SCENARIOS, Inputs, Scenario, make_inputs, run

pytestmark = pytest.mark.skipif(
    native_attention.attention_lanes() == 0, reason="the native kernels do not build here"
)
CPU = torch.device("cpu")
TEXT = {name: sc for name, sc in SCENARIOS.items() if not sc.images}


class Native:
    write_kv = staticmethod(reference.write_kv)
    canvas_attention = staticmethod(native_attention.canvas_attention)


def _no_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any fall back to the twin fails the test (the scenario must run the C kernel)."""

    def refuse(*args: object) -> None:
        raise AssertionError("the twin ran")

    monkeypatch.setattr(native_attention.reference, "canvas_attention", refuse)


@pytest.mark.parametrize("name", TEXT)
@pytest.mark.parametrize("head_dim", [32, 128])
@torch.inference_mode()
def test_matches_the_twin(name, head_dim, monkeypatch):
    sc = replace(TEXT[name], head_dim=head_dim)
    x = make_inputs(sc, CPU)
    want = run(reference, x, sc)
    _no_twin(monkeypatch)
    got = run(Native, x, sc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _bench_like(num_rows: int, window: int, decode: bool, tokens: int = 32) -> Scenario:
    """Rows as `bench-tiny`'s steps have them: prefixes of 105-214, pages of 16, 4:2 heads."""
    starts = tuple(105 + (37 * i) % 110 for i in range(num_rows))
    return Scenario(
        starts, (tokens,) * num_rows, (decode,) * num_rows, window=window, head_dim=64,
        page_size=16,
    )  # fmt: skip


@pytest.mark.parametrize("kind,tokens", [("decode", 32), ("encode", 45), ("encode", 1)])
@pytest.mark.parametrize("window", [0, 128])
@torch.inference_mode()
def test_bench_shapes_match_the_twin(kind, tokens, window, monkeypatch):
    """Canvases (tiled), prompt chunks (tiled, causal) and AR steps (one query per row: fewer
    score rows than a tile, taken straight from the keys' rows)."""
    sc = _bench_like(6, window, kind == "decode", tokens)
    x = make_inputs(sc, CPU)
    want = run(reference, x, sc)
    _no_twin(monkeypatch)
    torch.testing.assert_close(run(Native, x, sc), want, rtol=1e-5, atol=1e-5)


def _row_alone(x: Inputs, sc: Scenario, row: int) -> torch.Tensor:
    """Row `row` of `x` as the only row of a forward (same pages, same pools)."""
    first = sum(sc.num_tokens[:row])
    tokens = slice(first, first + sc.num_tokens[row])
    rows = reference.PagedRows.build(
        [sc.starts[row]], [sc.num_tokens[row]], [sc.decode[row]], [x.tables[row]]
    )
    alone = replace(x, q=x.q[tokens], k=x.k[tokens], v=x.v[tokens], rows=rows)
    return run(Native, alone, replace(sc, starts=(sc.starts[row],)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_rows_values_do_not_depend_on_its_batch(dtype):
    sc = replace(SCENARIOS["mixed-sliding-window-edge"], head_dim=64)
    x = make_inputs(sc, CPU, dtype)
    batched = run(Native, x, sc)
    assert batched.dtype == dtype
    first = 0
    for row, count in enumerate(sc.num_tokens):
        assert torch.equal(_row_alone(x, sc, row), batched[first : first + count])
        first += count


@torch.inference_mode()
def test_torchs_team_and_our_threads_give_the_same_bits(monkeypatch):
    if not build.on_torch_team("attention"):
        pytest.skip("the library is not on torch's OpenMP team here")
    sc = _bench_like(5, 128, True)
    x = make_inputs(sc, CPU)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        team = run(Native, x, sc)
        monkeypatch.setattr(native_attention, "on_torch_team", lambda name: False)
        assert torch.equal(run(Native, x, sc), team)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "change",
    [
        {"images": ((0, 2, 9),)},  # spans attended both ways
        {"head_dim": 16},  # not whole vector blocks
        {"dtype": torch.float16},  # bf16: test_native_bf16
        {"grad": True},
        {"long": True},  # more keys than MAX_KEYS
        {"pool_heads": True},  # pools of another head count than k and v
    ],
    ids=lambda c: next(iter(c)),
)
def test_the_twin_keeps_what_the_kernel_does_not_take(change, monkeypatch):
    sc = replace(SCENARIOS["images-full-mixed"], images=change.get("images", ()))
    sc = replace(sc, head_dim=change.get("head_dim", 32))
    x = make_inputs(sc, CPU, change.get("dtype", torch.float32))
    calls = []
    twin = reference.canvas_attention
    monkeypatch.setattr(
        native_attention.reference, "canvas_attention", lambda *a: calls.append(1) or twin(*a)
    )
    if change.get("long"):
        monkeypatch.setattr(native_attention, "MAX_KEYS", 8)
    if change.get("pool_heads"):  # the twin is called (and refuses it), nothing read out of bounds
        pools = x.k_pool[:, :1].contiguous(), x.v_pool[:, :1].contiguous()
        with torch.inference_mode(), pytest.raises(RuntimeError):
            Native.canvas_attention(x.q, x.k, x.v, *pools, x.rows, sc.window, 1.0)
        assert calls == [1]
        return
    with torch.inference_mode(not change.get("grad")):
        run(Native, x, sc)
    assert calls == [1]
