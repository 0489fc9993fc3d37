"""Prefix caching's page accounting: pure Python, no model. Requests are driven through the
scheduler with made-up row effects (AR mode: one token per row), and the accounting check
(free + held + cached = capacity, reference counts = holders) runs after every step."""

from __future__ import annotations

import pytest

from engine.kv_pages import KVPages, PageGeometry
from engine.params import DecodeMode, DecodingDefaults, SamplingParams
from engine.postprocess import TokenResult
from engine.prefix_cache import chain_hashes, root_hash
from engine.request import RequestState, SeqState
from engine.rows import ROW_KINDS
from engine.scheduler import InvariantError, Scheduler, SchedulerConfig

PAGE = 4


def scheduler(
    num_full: int = 64, num_sliding: int = 64, window: int = 6, max_seqs: int = 4, **kw: int
) -> Scheduler:
    geometry = PageGeometry(
        page_size=PAGE, sliding_window=window, max_pass_tokens=8, has_full=True, has_sliding=True
    )
    config = SchedulerConfig(max_num_seqs=max_seqs, max_prefill_chunk=8, **kw)
    return Scheduler(config, KVPages(geometry, num_full, num_sliding, prefix_caching=True))


def request(name: str, prompt: list[int], max_tokens: int = 3, key: str = "") -> RequestState:
    params = DecodingDefaults().resolve(SamplingParams(mode=DecodeMode.AR, max_tokens=max_tokens))
    context = len(prompt) + max_tokens
    return RequestState(name, prompt, params, context=context, canvas_length=8, cache_key=key)


def step(sched: Scheduler, token: int = 7) -> list[str]:
    """One step in which every AR-sampling row yields `token`; returns the finished ids."""
    plan = sched.schedule()
    effects = []
    for row in plan.rows:
        kind = ROW_KINDS[row.kind]
        effects.append(kind.effect(row, TokenResult(token) if kind.wants_token(row) else None))
    outputs = sched.update(plan, effects)
    sched.check()
    return [o.request_id for o in outputs if o.finish_reason is not None]


def run(sched: Scheduler, *seqs: RequestState) -> None:
    for seq in seqs:
        sched.add(seq)
    while sched.has_work():
        step(sched)


def test_a_prompt_that_is_a_prefix_of_another_shares_exactly_its_full_pages():
    sched = scheduler()
    first = request("a", list(range(10, 20)))  # 10 tokens: 2 full pages and a partial one
    sched.add(first)
    step(sched)
    shared = first.pages.full[:2]  # type: ignore[union-attr]
    run(sched)
    second = request("b", list(range(10, 20)) + [1, 2, 3, 4])
    sched.add(second)
    step(sched)
    assert second.num_cached == 8 and second.pages.full[:2] == shared  # type: ignore[union-attr]
    assert first.pages is None  # the first had ended: its pages were idle, now held again
    run(sched)


def test_two_prompts_sharing_a_page_sized_middle_never_share_pages():
    middle = [50, 51, 52, 53]
    a, b = [1, 2, 3, 4, *middle, 9, 9], [5, 6, 7, 8, *middle, 9, 9]
    root = root_hash("salt")
    assert not set(chain_hashes(root, a, PAGE)) & set(chain_hashes(root, b, PAGE))
    sched = scheduler()
    run(sched, request("a", a))
    second = request("b", b)
    run(sched, second)
    assert second.num_cached == 0


def test_only_requests_with_the_same_extra_key_share_pages():
    sched = scheduler()
    prompt = list(range(30, 42))
    run(sched, request("a", prompt, key="image:1"))
    other, same = request("b", prompt, key="image:2"), request("c", prompt, key="image:1")
    run(sched, other)
    run(sched, same)
    assert other.num_cached == 0 and same.num_cached == 8


def test_a_next_turn_reuses_the_committed_tokens_of_the_last_one():
    sched = scheduler()
    prompt = list(range(60, 69))  # 9 tokens; 3 AR tokens (7, 7, 7) follow
    run(sched, request("turn-1", prompt, max_tokens=4))
    # KV holds the prompt and the first 3 outputs (the last sampled token has none yet): 12
    turn2 = request("turn-2", [*prompt, 7, 7, 7, 7, 1, 2])
    run(sched, turn2)
    assert turn2.num_cached == 12
    assert sched.num_cached_tokens == 12 and sched.num_queried_tokens == 9 + 15


def test_a_hit_takes_the_cached_window_before_the_reuse_point_into_its_own_ring():
    sched = scheduler(window=6)  # a row reads the last 5 positions: pages 1 and 2 before 12
    a = request("a", list(range(100, 115)))
    run(sched, a)
    cache = sched.pages.cache
    assert cache is not None
    names = chain_hashes(root_hash(""), a.prompt_ids, PAGE)
    window = [cache.entries[names[j]].sliding for j in (1, 2)]
    b, c = request("b", list(range(100, 113)) + [0, 0]), request("c", list(range(100, 114)))
    sched.add(b)
    sched.add(c)
    plan = sched.schedule()
    assert b.num_cached == c.num_cached == 12 and plan.rows[0].start == 12
    b_ring, c_ring = b.pages.ring, c.pages.ring  # type: ignore[union-attr]
    # idle window pages join the first ring as they are; the second gets copies of them
    assert [b_ring[1 % len(b_ring)], b_ring[2 % len(b_ring)]] == window
    assert list(plan.copies) == [(window[0], c_ring[1]), (window[1], c_ring[2])]
    assert not set(window) & set(c_ring)
    run(sched)


def test_a_hit_needs_the_window_before_it_cached_too():
    sched = scheduler(window=6)
    a = request("a", list(range(100, 115)))
    run(sched, a)
    cache = sched.pages.cache
    assert cache is not None
    names = chain_hashes(root_hash(""), a.prompt_ids, PAGE)
    page = cache.entries[names[2]].sliding
    assert page is not None
    cache.drop_sliding(page)  # what eviction does: forget it, then free it
    sched.pages.sliding.release([page])
    b = request("b", list(range(100, 115)))
    run(sched, b)
    assert b.num_cached == 8  # page 2 lacks its window content: reuse stops before it


def test_a_ring_overwriting_a_named_page_keeps_it_cached_on_a_fresh_page():
    sched = scheduler(window=2, num_sliding=64)  # ring: ceil((1 + 8) / 4) + 1 = 4 pages
    long = request("long", list(range(200, 230)))  # 30 positions: the ring wraps
    run(sched, long)
    again = request("again", list(range(200, 230)))
    run(sched, again)
    assert again.num_cached == 28  # every full page (7) but the last position's


def test_without_a_free_sliding_page_a_wrapped_page_is_forgotten_not_corrupted():
    sched = scheduler(window=2, num_sliding=4, max_seqs=1)  # exactly one ring, nothing spare
    run(sched, request("long", list(range(200, 230))))
    again = request("again", list(range(200, 230)))
    run(sched, again)
    assert again.num_cached == 28  # the window before 28 was still in the ring
    cache = sched.pages.cache
    assert cache is not None
    names = chain_hashes(root_hash(""), again.prompt_ids, PAGE)
    assert [cache.entries[n].sliding is None for n in names[:4]] == [True] * 4  # overwritten
    assert sched.pages.sliding.num_free + len(cache.idle_sliding) == 4


def test_eviction_under_a_small_budget_takes_idle_pages_least_recent_first_and_never_held():
    sched = scheduler(num_full=12, max_seqs=2)
    for i in range(12):  # distinct 10-token prompts: 4 pages each, 12 pages in all
        run(sched, request(f"p{i}", [1000 + i] * 10))
        assert sched.pages.usage() == 0.0
    recent = request("recent", [1011] * 10)
    old = request("old", [1000] * 10)
    run(sched, recent)
    run(sched, old)
    assert recent.num_cached == 8 and old.num_cached == 0


def test_two_choices_of_one_prompt_compute_it_once():
    sched = scheduler()
    prompt = list(range(300, 320))
    first, second = request("c0", prompt), request("c1", prompt)
    sched.add(first)
    sched.add(second)
    step(sched)
    assert second.state is SeqState.WAITING  # waits for the first's prefill of its pages
    run(sched)
    assert first.num_cached == 0 and second.num_cached == 16


def test_reset_forgets_every_cached_page_and_running_requests_keep_theirs():
    sched = scheduler()
    prompt = list(range(400, 412))
    run(sched, request("a", prompt))
    running = request("running", list(range(500, 520)), max_tokens=6)
    sched.add(running)
    step(sched)
    step(sched)
    assert sched.reset_prefix_cache() > 0
    sched.check()
    run(sched)
    after = request("after", prompt)
    run(sched, after)
    assert after.num_cached == 0
    assert sched.pages.full.num_free + len(sched.pages.idle_ids()[0]) == 64


def test_the_check_catches_a_reference_count_that_does_not_match_the_holders():
    sched = scheduler()
    sched.add(request("a", list(range(10))))
    step(sched)
    page = next(iter(sched.pages.refs))
    sched.pages.refs[page] += 1
    with pytest.raises(InvariantError, match="reference counts"):
        sched.check()
