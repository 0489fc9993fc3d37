"""The per-step CPU thread count (`engine.cpu_threads.ThreadTuner`), on made-up step times."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.cpu_threads import SWITCH_MARGIN, ThreadTuner, auto_choices, make_tuner


def run(tuner: ThreadTuner, num_tokens: int, cost: dict[int, float], steps: int) -> list[int]:
    """`steps` steps of `num_tokens` tokens, each taking cost[threads] seconds."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(num_tokens)
        tuner.observe(num_tokens, threads, cost[threads])
        chosen.append(threads)
    return chosen


def fake_tuner(choices: tuple[int, ...] = (1, 2), probe_every: int = 8) -> ThreadTuner:
    return ThreadTuner(choices, probe_every=probe_every, set_threads=lambda _n: None)


def test_each_count_is_tried_in_turn_then_the_faster_runs_with_a_probe_every_few_steps(caplog):
    caplog.set_level("INFO", "engine.cpu_threads")
    tuner = fake_tuner()
    chosen = run(tuner, 16, {1: 0.010, 2: 0.012}, 6 + 24)
    assert chosen[:6] == [2, 1, 2, 1, 2, 1]  # three steps each, in turn, the largest first
    after = chosen[6:]
    # Two more probes at once (the window of 5 ratios fills), then one every 8th step.
    assert [i for i, n in enumerate(after) if n == 2] == [1, 3, 9, 17]
    assert "steps of ~16 tokens run with 1 (measured; step time 1.20x with 2)" in caplog.text
    # The other way round in another bucket: 1,024 tokens prefer two threads.
    chosen = run(tuner, 1024, {1: 0.200, 2: 0.170}, 6 + 8)
    assert chosen[6:] == [2, 1, 2, 1, 2, 2, 2, 2]  # two threads from the decision on
    assert chosen[:6] == [2, 1, 2, 1, 2, 1]  # too far from the first bucket to borrow its choice
    # Each bucket (by its lowest token count): the count that runs and the other's time ratio.
    summary = tuner.summary()
    assert summary[14] == (1, {2: pytest.approx(1.2)})
    assert summary[862] == (2, {1: pytest.approx(0.200 / 0.170)})


def test_probes_grow_rarer_the_slower_the_others_measured():
    # Three times slower: a probe every 8 x probe_every steps instead of every probe_every.
    chosen = run(fake_tuner(probe_every=4), 16, {1: 0.010, 2: 0.030}, 6 + 64)
    assert chosen[6:].count(2) == 4  # 2 filling the window, then steps 31 and 63


def test_a_new_bucket_next_to_a_decided_one_starts_from_its_choice():
    tuner = fake_tuner(probe_every=16)
    run(tuner, 16, {1: 0.010, 2: 0.020}, 8)
    # 24 tokens: a bucket of its own, a factor 1.5 away: one thread runs from its first step;
    # two threads are tried every 4th step (probe_every // 4) until each has 3 samples.
    chosen = run(tuner, 24, {1: 0.012, 2: 0.014}, 16)
    assert chosen[:12] == [1, 1, 1, 2] * 3 and chosen[12:] == [1, 1, 1, 2]  # decided: 1
    # 64 tokens is further than a factor of two from any decided bucket: each in turn.
    assert run(tuner, 64, {1: 0.05, 2: 0.03}, 4) == [2, 1, 2, 1]


def test_fewer_threads_must_win_by_a_margin_and_more_threads_need_not():
    """A bucket starts at the largest count. Too few threads on a large step costs far more
    than too many on a small one (bench-tiny's 16 canvases ran 1.6x slower on one thread, chosen
    after three noisy probes), so a smaller count replaces the incumbent only when it measured
    at least SWITCH_MARGIN faster; a larger one replaces it when faster at all."""
    assert pytest.approx(0.1) == SWITCH_MARGIN
    chosen = run(fake_tuner(), 16, {1: 0.0096, 2: 0.010}, 6 + 8)
    assert chosen[:6] == [2, 1, 2, 1, 2, 1] and chosen[6:].count(2) >= 6  # 4% faster: stays
    chosen = run(fake_tuner(), 16, {1: 0.0088, 2: 0.010}, 6 + 8)
    assert chosen[6:].count(1) >= 6  # 12% faster: one thread runs from the decision on
    # Once one thread runs, two threads replace it when faster at all.
    tuner = fake_tuner(probe_every=4)
    run(tuner, 64, {1: 0.0088, 2: 0.010}, 20)
    chosen = run(tuner, 64, {1: 0.0100, 2: 0.0097}, 60)
    assert tuner.pick(64) == 2 and chosen[-8:].count(2) >= 6  # a probe of one every 4th


def test_larger_steps_than_a_bucket_settled_on_every_thread_are_not_probed():
    """bench-tiny's prompt step (2,900 tokens, once a burst) probed on one thread in its first
    runs cost a step's worth each time; steps larger than a bucket that chose every thread run
    every thread unprobed. Smaller ones, and larger ones next to a one-thread choice, measure."""
    tuner = fake_tuner()
    run(tuner, 32, {1: 0.010, 2: 0.006}, 6)  # decided: two threads
    assert run(tuner, 2900, {1: 0.5, 2: 0.3}, 10) == [2] * 10
    assert tuner.summary()[2436] == (2, {})  # the bucket of 2,436 to 3,444 tokens
    assert run(tuner, 8, {1: 0.001, 2: 0.001}, 4) == [2, 1, 2, 1]  # smaller: measured
    one = fake_tuner()
    run(one, 32, {1: 0.006, 2: 0.010}, 6)  # decided: one thread
    assert run(one, 2900, {1: 0.5, 2: 0.3}, 4) == [2, 1, 2, 1]


def test_steps_within_half_an_octave_share_a_bucket_and_further_ones_do_not():
    assert ThreadTuner.bucket(16) == ThreadTuner.bucket(18) != ThreadTuner.bucket(24)
    assert ThreadTuner.bucket(0) == ThreadTuner.bucket(1) == 0


def test_a_change_of_load_is_noticed_through_the_probes():
    tuner = fake_tuner(probe_every=4)
    run(tuner, 64, {1: 0.010, 2: 0.012}, 20)
    assert tuner.pick(64) == 1
    # The machine's other work goes away: two threads now take half the time. Probes bring
    # the median of two-thread steps down; once it is below one thread's, two run.
    chosen = run(tuner, 64, {1: 0.010, 2: 0.005}, 40)
    assert chosen[:4].count(1) >= 3 and chosen[-8:].count(2) >= 7  # rarer probes of one
    assert tuner.summary()[54] == (2, {1: pytest.approx(2.0)})


def test_one_slow_step_does_not_flip_the_choice():
    tuner = fake_tuner(probe_every=4)
    run(tuner, 64, {1: 0.010, 2: 0.012}, 6)
    # A burst of other work slows one step of the incumbent; the median of its recent steps
    # keeps the probes' ratios sound.
    threads = tuner.choose(64)
    tuner.observe(64, threads, 1.0)
    assert threads == 1 and tuner.summary()[54] == (1, {2: pytest.approx(1.2)})
    assert run(tuner, 64, {1: 0.010, 2: 0.012}, 8).count(1) == 5  # and three probes


def test_a_machine_that_slows_down_does_not_flip_the_choice():
    """Probes are compared with the incumbent's steps beside them, not with older probes: a
    VM at half speed makes every step slower, and the ratio stays."""
    tuner = fake_tuner(probe_every=4)
    run(tuner, 64, {1: 0.010, 2: 0.012}, 20)
    chosen = run(tuner, 64, {1: 0.020, 2: 0.024}, 40)
    assert chosen.count(2) == 10  # probes only (every 4th step)
    assert tuner.summary()[54] == (1, {2: pytest.approx(1.2)})


def test_a_single_count_is_fixed_and_exact_numerics_keep_torchs_own_count():
    assert make_tuner((), exact=False) is None
    assert make_tuner((1, 2), exact=True) is None  # torch's own count, as a reference run has
    assert make_tuner((3,), exact=True).choices == (3,)  # type: ignore[union-attr]
    assert make_tuner((2, 1), exact=False).choices == (1, 2)  # type: ignore[union-attr]
    assert run(fake_tuner((3,)), 16, {3: 0.01}, 5) == [3] * 5
    assert auto_choices(1) == (1,) and auto_choices(2) == (1, 2) and auto_choices(8) == (7, 8)
    with pytest.raises(ValueError, match="thread counts must be >= 1"):
        ThreadTuner((0, 1))
    tuner = fake_tuner()
    tuner.observe(16, 5, 0.1)  # a count outside the choices (set by hand) is not counted
    assert tuner.summary() == {14: (2, {})}


def test_the_count_is_set_in_the_thread_that_runs_the_step():
    """torch.set_num_threads is per thread (OpenMP and MKL settings): the step loop's own."""
    main_threads = torch.get_num_threads()
    seen: list[int] = []

    def step_loop() -> None:
        torch.ones(8) + 1  # this thread's settings exist before the tuner's first step
        tuner = ThreadTuner((1, 2))
        for _ in range(4):
            threads = tuner.choose(64)
            seen.append(torch.get_num_threads() == threads)
            tuner.observe(64, threads, 0.01)

    worker = threading.Thread(target=step_loop)
    worker.start()
    worker.join()
    assert seen == [True] * 4
    assert torch.get_num_threads() == main_threads  # the caller's own count is untouched


CONFINE = """
import threading, torch
from engine.cpu_threads import ThreadTuner, confine_to_steps, one_thread
own = confine_to_steps()
seen = {"own": own, "main": torch.get_num_threads()}
def helper():
    one_thread()  # what a confined server's helper threads start with
    torch.ones(4096) + 1
    seen["helper"] = torch.get_num_threads()
def step_loop():
    seen["step"] = ThreadTuner((own,)).choose(64) == torch.get_num_threads() == own
    t = threading.Thread(target=helper)
    t.start(); t.join()
    ThreadTuner((own,)).choose(64)  # set again on every step (a helper's set changes MKL's)
    seen["step after helper"] = torch.get_num_threads()
threading.Thread(target=step_loop).start()
import time; time.sleep(0.5)
print(seen)
"""


def test_confined_parallel_regions_run_on_the_step_loop_alone():
    """`canvas serve` confines torch's parallel regions to the step loop before the model loads:
    the main thread (and a helper thread set to one) runs one thread, the step loop sets the
    count torch had. A second OpenMP team made every region of the step loop's pay a wake-up
    (bench-tiny at 16 canvases through the server: 210-250 tokens/s, 640 confined)."""
    import ast
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", CONFINE], env=env, capture_output=True, text=True, check=True
    )
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert seen["own"] == 2 and seen["main"] == 1, seen
    assert seen["step"] is True and seen["step after helper"] == 2, seen
    assert seen["helper"] == 1, seen


def test_the_thread_policy_gives_a_confined_server_torchs_own_count_where_it_does_not_measure(
    monkeypatch,
):
    """`choose_threads` (the engine's policy for `--threads`): a server that confined torch to
    its step loop (`own`: the count torch had) runs exact numerics, which are never measured,
    and an OMP_NUM_THREADS setting at that count, not at the confined thread's one."""
    from engine.cpu_threads import choose_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(4)))
    assert choose_threads("auto", own=4) == (3, 4)  # fast numerics measure
    assert choose_threads("auto", own=4, exact=True) == (4,)
    assert choose_threads(None, own=4, exact=True) == (4,)
    assert choose_threads("2", own=4, exact=True) == (2,)  # a fixed count stays fixed
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(None, own=3) == (3,)
    with pytest.raises(ValueError, match="--threads must be 'auto'"):
        choose_threads("auto-ish", own=4)
