"""Scheduler and page accounting: pure Python, no model."""

from __future__ import annotations

import pytest

from engine.kv_pages import IdPool, KVPages, PageGeometry
from engine.params import DecodeMode, DecodingDefaults, SamplingParams
from engine.postprocess import CanvasResult
from engine.request import RequestState, SeqState
from engine.rows import ROW_KINDS
from engine.scheduler import InvariantError, RowKind, Scheduler, SchedulerConfig
from engine.types import FinishReason, QueueFull, RowEffect


def geometry(**kw) -> PageGeometry:
    args = dict(page_size=4, sliding_window=8, max_pass_tokens=8, has_full=True, has_sliding=True)
    args.update(kw)
    return PageGeometry(**args)


def seq(
    name: str, prompt: int = 6, context: int = 22, length: int = 8, ar: bool = False
) -> RequestState:
    mode = DecodeMode.AR if ar else DecodeMode.DIFFUSION
    params = DecodingDefaults().resolve(SamplingParams(mode=mode))
    return RequestState(name, [0] * prompt, params, context=context, canvas_length=length)


def test_pool_hands_out_and_takes_back_pages():
    pool = IdPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.release(a)
    assert pool.num_free == 4


def test_sliding_ring_covers_window_plus_one_pass_and_is_reused():
    g = geometry()
    # window-1 = 7 read positions + 8 new ones span at most ceil(15/4)+1 = 5 pages
    assert g.sliding_ring(10_000) == 5
    assert g.sliding_ring(6) == 2  # never more than the context needs
    pages = KVPages(g, num_full_pages=100, num_sliding_pages=10)
    tables = pages.allocate(40)
    assert len(tables.full) == 10 and len(tables.ring) == 5
    table = tables.sliding()
    assert len(table) == 10 and table[0] == table[5] and len(set(table)) == 5


def test_ring_pages_read_and_written_in_one_pass_never_collide():
    g = geometry()
    pages = KVPages(g, 100, 10)
    table = pages.allocate(200).sliding()
    for start in range(0, 190):
        lo = max(0, start - (g.sliding_window - 1))
        spanned = range(lo // g.page_size, (start + g.max_pass_tokens - 1) // g.page_size + 1)
        physical = [table[i] for i in spanned if i < len(table)]
        assert len(physical) == len(set(physical)), start


def test_usage_and_release():
    pages = KVPages(geometry(), 10, 10)
    assert pages.usage() == 0.0
    t = pages.allocate(12)
    assert 0 < pages.usage() < 1
    pages.release(t)
    assert pages.usage() == 0.0


def effect(row, converged: set[str]) -> RowEffect:  # type: ignore[no-untyped-def]
    """The row kind's own effect of a step that samples nothing (a DENOISE row's canvas
    converges to ones when its request is in `converged`)."""
    kind = ROW_KINDS[row.kind]
    if row.kind is RowKind.DENOISE:
        done = row.seq_id in converged
        return kind.effect(row, CanvasResult(done, 3, [1] * row.num_tokens if done else None))
    return kind.effect(row, None)


def run_rows(sched: Scheduler, converged: set[str] = frozenset()) -> list:
    plan = sched.schedule()
    sched.update(plan, [effect(row, converged) for row in plan.rows])
    sched.check()
    return list(plan.rows)


def kinds(rows: list) -> list[tuple[RowKind, int, int, bool]]:
    return [(r.kind, r.start, r.num_tokens, r.starts_canvas) for r in rows]


def test_a_request_goes_prefill_denoise_commit_denoise():
    """The next canvas's first denoising step rides along with each commit pass (the same
    forward; one row each), and the first canvas's with the prompt's last chunk."""
    sched = Scheduler(SchedulerConfig(max_prefill_chunk=4), KVPages(geometry(), 100, 100))
    sched.add(seq("a", prompt=6))
    assert kinds(run_rows(sched)) == [(RowKind.PREFILL, 0, 4, False)]
    last_chunk = kinds(run_rows(sched))
    assert last_chunk == [(RowKind.PREFILL, 4, 2, False), (RowKind.DENOISE, 6, 8, True)]
    assert kinds(run_rows(sched, {"a"})) == [(RowKind.DENOISE, 6, 8, False)]  # converges
    assert kinds(run_rows(sched)) == [(RowKind.COMMIT, 6, 8, False), (RowKind.DENOISE, 14, 8, True)]
    assert sched.requests["a"].num_computed == 14 and sched.requests["a"].in_canvas
    assert kinds(run_rows(sched)) == [(RowKind.DENOISE, 14, 8, False)]


@pytest.mark.parametrize("mode", [DecodeMode.AR, DecodeMode.HYBRID])
def test_modes_that_sample_from_the_encoder_wait_for_it(mode: DecodeMode):
    """AR and hybrid requests take their next token from the ENCODE pass: nothing rides along."""
    sched = Scheduler(SchedulerConfig(), KVPages(geometry(), 100, 100))
    params = DecodingDefaults().resolve(SamplingParams(mode=mode))
    sched.add(RequestState("a", [0] * 6, params, context=22, canvas_length=8))
    assert [r.kind for r in run_rows(sched)] == [RowKind.PREFILL]


def test_a_first_step_that_does_not_fit_the_budget_waits_for_the_next_forward():
    config = SchedulerConfig(max_num_batched_tokens=12)
    sched = Scheduler(config, KVPages(geometry(), 100, 100))
    sched.add(seq("a", prompt=6))
    run_rows(sched)  # the prompt
    run_rows(sched, {"a"})  # the first canvas converges at once
    assert kinds(run_rows(sched)) == [(RowKind.COMMIT, 6, 8, False)]
    assert kinds(run_rows(sched)) == [(RowKind.DENOISE, 14, 8, True)]


def test_ar_request_goes_prefill_then_one_token_rows():
    sched = Scheduler(SchedulerConfig(), KVPages(geometry(), 100, 100))
    sched.add(seq("a", prompt=3, ar=True))
    assert [r.kind for r in run_rows(sched)] == [RowKind.PREFILL]
    rows = run_rows(sched)
    assert [(r.kind, r.start, r.num_tokens) for r in rows] == [(RowKind.AR, 3, 1)]


def test_converged_canvas_leaves_without_waiting_for_slower_rows():
    sched = Scheduler(SchedulerConfig(), KVPages(geometry(), 100, 100))
    for name in "ab":
        sched.add(seq(name))
    run_rows(sched)  # both prefill
    run_rows(sched)  # both start a canvas
    run_rows(sched, converged={"a"})  # a converges, b does not
    rows = run_rows(sched)
    assert [(r.seq_id, r.kind, r.start) for r in rows] == [
        ("a", RowKind.COMMIT, 6),
        ("a", RowKind.DENOISE, 14),
        ("b", RowKind.DENOISE, 6),
    ]


def test_admission_waits_for_pages_and_finish_frees_them():
    pages = KVPages(geometry(), num_full_pages=8, num_sliding_pages=100)
    sched = Scheduler(SchedulerConfig(), pages)
    sched.add(seq("a", context=22))  # 6 full pages
    sched.add(seq("b", context=22))
    run_rows(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    sched.end("a")
    assert pages.full.num_free == 8
    run_rows(sched)
    assert sched.num_running == 1 and "b" in sched.running


def test_row_and_token_budgets_are_respected():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10, max_prefill_chunk=100)
    sched = Scheduler(config, KVPages(geometry(), 100, 100))
    for name in "abc":
        sched.add(seq(name, prompt=6))
    rows = run_rows(sched)
    assert sched.num_running == 2  # max_num_seqs
    assert sum(r.num_tokens for r in rows) <= 10
    assert [r.num_tokens for r in rows] == [6, 4]  # the second prompt is chunked to the budget


def test_queue_limit_and_oversized_requests_are_refused():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_queue=1), KVPages(geometry(), 4, 100))
    with pytest.raises(ValueError, match="does not fit"):
        sched.add(seq("huge", context=1000))
    sched.add(seq("a", context=8))
    sched.add(seq("b", context=8))  # one running slot + one queue slot
    with pytest.raises(QueueFull, match="max_num_seqs \\+ max_queue = 2"):
        sched.add(seq("c", context=8))
    run_rows(sched)  # a is admitted; b still waits; still full
    with pytest.raises(QueueFull):
        sched.add(seq("c", context=8))


def test_abort_of_a_waiting_request_removes_it():
    sched = Scheduler(SchedulerConfig(), KVPages(geometry(), 100, 100))
    sched.add(seq("a"))
    assert sched.end("a").state is SeqState.FINISHED
    assert sched.end("a") is None  # ending twice releases nothing twice
    assert not sched.has_work()
    sched.check()


def test_admission_takes_pages_and_a_sampler_slot_and_every_way_out_returns_both():
    pages = KVPages(geometry(), 100, 100)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3), pages)
    for name in "abcd":
        sched.add(seq(name, ar=True))
    rows = run_rows(sched)
    assert [r.admitted for r in rows] == [True, True, True]
    assert sorted(sched.running[n].slot for n in "abc") == [0, 1, 2]
    assert sched.slots.num_free == 0 and sched.num_waiting == 1
    finished = sched.update(
        sched.schedule(),
        [
            RowEffect(tokens=[7], finish_reason=FinishReason.STOP),
            RowEffect(error="boom"),
            RowEffect(),
        ],
    )
    assert [(o.request_id, o.finish_reason, o.error) for o in finished] == [
        ("a", FinishReason.STOP, None),
        ("b", FinishReason.ABORT, "boom"),
    ]
    sched.check()
    assert sched.end("c") is not None and sched.end("d") is not None
    assert sched.slots.num_free == 3 and pages.usage() == 0.0
    sched.check()


def test_the_check_catches_a_leaked_slot_and_a_request_known_twice():
    sched = Scheduler(SchedulerConfig(), KVPages(geometry(), 100, 100))
    sched.add(seq("a"))
    run_rows(sched)
    sched.running["a"].slot = None  # leaked: neither held nor free
    with pytest.raises(InvariantError, match="lacks its pages or slot"):
        sched.check()
    sched.running["a"].slot = 0
    sched.waiting.append(sched.running["a"])
    with pytest.raises(InvariantError, match="both waiting and running"):
        sched.check()


def test_prefill_chunks_never_split_an_image():
    """Images at positions 2-5 and 7-13 (attended both ways: `image_spans`), a budget of 4:
    a chunk ends before an image that does not fit, and one that starts with an image takes
    it whole, past the budget (never past max_prefill_chunk)."""
    config = SchedulerConfig(max_num_batched_tokens=4, max_prefill_chunk=8)
    sched = Scheduler(config, KVPages(geometry(max_pass_tokens=8), 100, 100))
    request = seq("a", prompt=16, context=32)
    request.image_spans = ((2, 5), (7, 13))
    sched.add(request)
    chunks = [kinds(run_rows(sched))[0][1:3] for _ in range(5)]
    assert chunks == [(0, 2), (2, 4), (6, 1), (7, 7), (14, 2)]


def test_a_cache_hit_never_ends_inside_an_image():
    """A hit ends at a page boundary outside every image (an image's tokens are computed in
    one pass, with the whole image): with pages of 4, an image at 5-17 leaves one page."""
    pages = KVPages(geometry(), 100, 100, prefix_caching=True)
    sched = Scheduler(SchedulerConfig(), pages)
    sched.add(seq("a", prompt=20, context=32))
    run_rows(sched)  # the prompt: its full pages are named
    names = sched.requests["a"].page_names
    assert pages.find(names, 20).num_pages == 4
    assert pages.find(names, 20, [(5, 17)]).num_pages == 1
    assert pages.find(names, 20, [(4, 17)]).num_pages == 1  # ends right before the image
    assert pages.find(names, 20, [(3, 17)]) is None
