"""The KV write and canvas attention as `torch.library` custom ops (`kernels.ops`): the same
values as the twins on CPU, registrations that `torch.library.opcheck` accepts (schema and
mutated pools, autograd registration, the fake implementation against the real one), and a
model forward that runs on the meta device through them (the twins alone cannot: they index
by data). The first op call of a process imports torch._dynamo (seconds)."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import LayerType
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache, Row
from kernels import ops, reference, resolve_kernels
from loadtest.gpu.bench import meta_model, model_config
from tests.kernels.attention_cases import SCENARIOS, make_inputs, run


@pytest.mark.parametrize(
    "name", ["mixed-full-page-crossing", "mixed-sliding-window-edge", "images-full-mixed"]
)
def test_ops_give_the_twins_values_and_write_the_same_pages(name: str) -> None:
    sc = SCENARIOS[name]
    x = make_inputs(sc, torch.device("cpu"))
    assert torch.equal(run(ops, x, sc), run(reference, x, sc))
    pools = [(x.k_pool.clone(), x.v_pool.clone()) for _ in range(2)]
    ops.write_kv(x.k, x.v, *pools[0], x.rows)
    reference.write_kv(x.k, x.v, *pools[1], x.rows)
    assert not torch.equal(pools[0][0].nan_to_num(), x.k_pool.nan_to_num())  # it wrote
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(*pools, strict=True))


def test_opcheck_accepts_both_registrations() -> None:
    sc = SCENARIOS["mixed-sliding-window-edge"]
    x = make_inputs(sc, torch.device("cpu"))
    rows = (*ops._flat(x.rows), ops._host(x.rows))
    k_pool, v_pool = x.k_pool.nan_to_num(), x.v_pool.nan_to_num()  # opcheck compares values
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    write = (x.k, x.v, k_pool, v_pool, *rows)
    torch.library.opcheck(torch.ops.canvas.write_kv, write, test_utils=checks)
    attend = (x.q, x.k, x.v, k_pool, v_pool, *rows[:-1], None, rows[-1], sc.window, 1.0)
    torch.library.opcheck(torch.ops.canvas.canvas_attention, attend, test_utils=checks)
    sc = SCENARIOS["images-sliding-longer-than-window"]  # with spans (image tokens)
    x = make_inputs(sc, torch.device("cpu"))
    assert x.rows.span is not None
    pools = x.k_pool.nan_to_num(), x.v_pool.nan_to_num()
    rows = (*ops._flat(x.rows), x.rows.span, ops._host(x.rows))
    attend = (x.q, x.k, x.v, *pools, *rows, sc.window, 1.0)
    torch.library.opcheck(torch.ops.canvas.canvas_attention, attend, test_utils=checks)


def meta_forward(with_ops: bool) -> torch.Tensor:
    """A mixed forward (a prefill chunk beside a canvas) of the toy DiffusionGemma (the real
    stack scaled down: sliding and full layers, experts) in bf16, all on the meta device."""
    config = model_config(toy=True)
    text, meta = config.text, torch.device("meta")
    model = meta_model(config, torch.bfloat16)
    model.init_rope(meta)
    kernels = resolve_kernels("cpu", "twins")
    model.bind_kernels(kernels.with_custom_ops() if with_ops else kernels)
    pages = {layer_type: list(range(8)) for layer_type in LayerType}
    canvas = config.canvas_length
    rows = [Row(Mode.ENCODE, 0, 20, pages), Row(Mode.DECODE, 20, canvas, pages)]
    batch = ForwardBatch(rows, text.sliding_window, 16)
    cache = PagedKVCache(text, dict.fromkeys(LayerType, 16), 16, torch.bfloat16, meta)
    ids = torch.zeros(20 + canvas, dtype=torch.long, device=meta)
    with torch.inference_mode():
        return model(ids, [None], batch, cache)


def test_a_model_forward_runs_on_the_meta_device_through_the_ops() -> None:
    hidden = meta_forward(with_ops=True)
    config = model_config(toy=True)
    assert hidden.device.type == "meta" and hidden.dtype == torch.bfloat16
    assert hidden.shape == (20 + config.canvas_length, config.text.hidden_size)
    with pytest.raises(NotImplementedError, match="nonzero"):
        meta_forward(with_ops=False)


def test_custom_ops_are_for_fast_numerics() -> None:
    with pytest.raises(ValueError, match="fast numerics only"):
        resolve_kernels("cpu", "twins", exact=True).with_custom_ops()
