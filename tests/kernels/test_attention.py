"""Canvas attention and the paged KV write: Triton kernel vs twin, and the batched twin (fast
numerics) vs the row-by-row twin (exact numerics)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import reference

pytest.importorskip("triton")
from kernels import triton_attention  # noqa: E402  (needs triton)
from tests.kernels.attention_cases import SCENARIOS, Scenario, make_inputs, run  # noqa: E402

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_canvas_attention_matches_twin(name: str, device: torch.device) -> None:
    sc = SCENARIOS[name]
    x = make_inputs(sc, device)
    assert not x.q.is_contiguous() and not x.k.is_contiguous()
    got, want = run(triton_attention, x, sc), run(reference, x, sc)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_canvas_attention_fp16_matches_twin(device: torch.device) -> None:
    sc = SCENARIOS["mixed-sliding-window-edge"]
    x = make_inputs(sc, device, torch.float16)
    got, want = run(triton_attention, x, sc), run(reference, x, sc)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", ["mixed-full-page-crossing", "mixed-sliding-window-edge"])
def test_write_kv_matches_twin_and_leaves_decode_rows_alone(
    name: str, device: torch.device
) -> None:
    sc = SCENARIOS[name]
    x = make_inputs(sc, device)
    pools = [x.k_pool.clone(), x.v_pool.clone()]
    triton_attention.write_kv(x.k, x.v, x.k_pool, x.v_pool, x.rows)
    reference.write_kv(x.k, x.v, pools[0], pools[1], x.rows)
    assert torch.equal(x.k_pool.nan_to_num(7.0), pools[0].nan_to_num(7.0))
    assert torch.equal(x.v_pool.nan_to_num(7.0), pools[1].nan_to_num(7.0))
    first_decode = sc.decode.index(True)
    page = x.tables[first_decode][sc.starts[first_decode] // sc.page_size]
    slot = sc.starts[first_decode] % sc.page_size
    token = sum(sc.num_tokens[:first_decode])
    assert not torch.equal(x.k_pool[page, :, slot], x.k[token])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_batched_twin_matches_the_row_by_row_twin(name: str) -> None:
    """Fast numerics' twin (every row in one masked SDPA over index-gathered pages) against
    exact numerics' (one row at a time over exactly its own keys, the reference's order);
    pages no row reads hold NaN, so any padding that leaked would show."""
    sc = SCENARIOS[name]
    x = make_inputs(sc, torch.device("cpu"))
    want = reference.canvas_attention_rowwise(
        x.q, x.k, x.v, x.k_pool, x.v_pool, x.rows, sc.window, 1.0
    )
    got = run(reference, x, sc)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Its index tensors and mask are built once per rows and window, then reused (every layer
    # of a forward): the second call reads them back and gives the same values.
    # A mixed forward (DECODE and ENCODE rows) runs as one call per kind, each padded among
    # its own rows, whose plans live with the split.
    mixed = True in sc.decode and False in sc.decode
    split = x.rows.memo.get("by_kind", [])
    assert len(split) == (2 if mixed else 0)
    memos = [x.rows.memo, *(part.memo for part, _ in split)]
    plans = [key for memo in memos for key in memo if key[0] == "canvas_attention"]
    want_plan = ("canvas_attention", sc.window, sc.page_size, sc.num_kv_heads)
    assert plans == [want_plan] * (2 if mixed else 1)
    assert torch.equal(run(reference, x, sc), got)


def test_spans_widen_what_image_tokens_see_and_nothing_else() -> None:
    """An image's tokens see the whole image (later ones too, and on a sliding layer earlier
    ones past the window); text tokens, and the tokens without spans, are plain causal."""
    sc = SCENARIOS["images-sliding-longer-than-window"]
    x = make_inputs(sc, torch.device("cpu"))
    causal = reference.PagedRows.build(
        list(sc.starts), list(sc.num_tokens), list(sc.decode), x.tables
    )
    with_span = run(reference, x, sc)
    without = run(reference, replace(x, rows=causal), sc)
    differs = (with_span - without).abs().amax((1, 2)) > 0  # [N]
    image = torch.zeros_like(differs)
    for row, first, last in sc.images:
        offset = sum(sc.num_tokens[:row])
        image[offset + first : offset + last + 1] = True
    assert not differs[~image].any()
    assert differs[image].all()


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("head_dim,num_kv_heads,window", [(256, 8, 1024), (512, 2, 0)])
def test_canvas_attention_real_shapes_bf16_on_gpu(
    head_dim: int, num_kv_heads: int, window: int
) -> None:
    sc = Scenario(
        (3000, 700, 0), (256, 256, 300), (True, True, False), window=window,
        num_heads=16, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=64,
    )  # fmt: skip
    x = make_inputs(sc, torch.device("cuda"), torch.bfloat16)
    got, want = run(triton_attention, x, sc), run(reference, x, sc)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
