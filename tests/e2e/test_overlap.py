"""Overlapped steps (`engine.device.overlap`): each step's outputs are handed over while the next
step executes, the tokens are the serial loop's for the same seeds in every mode, commands
between steps and failing steps are handled as in the serial loop, and exact numerics never
overlap. The forward is timed without a device-wide synchronize."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.device import overlap
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.types import StepStats
from server.cli.config import ENGINE_FLAGS, build_config
from server.cli.serve import add_serve_arguments

GATHER = (0.5, 2.0)  # every request of a test arrives before the first step


def make_llm(path: Any, overlapped: bool, exact: bool = False) -> LLM:
    return LLM.from_pretrained(path, config=EngineConfig(overlap=overlapped), exact=exact)


def serve(
    llm: LLM,
    params: list[SamplingParams],
    setup: Callable[[AsyncEngine], None] = lambda engine: None,
) -> list[list[int] | Exception]:
    """Each request's tokens (or what it raised), all sent at once through an AsyncEngine."""
    engine = AsyncEngine(llm.engine, gather=GATHER, warmup=False)
    setup(engine)
    resolved = [llm.validator.validate([5, 6, 7 + i], p) for i, p in enumerate(params)]

    async def one(i: int) -> list[int] | Exception:
        tokens: list[int] = []
        try:
            async for out in engine.generate(f"r{i}", [5, 6, 7 + i], resolved[i]):
                tokens += out.new_token_ids
        except Exception as exc:
            return exc
        return tokens

    async def main() -> list[list[int] | Exception]:
        engine.start(asyncio.get_running_loop())
        return list(await asyncio.gather(*(one(i) for i in range(len(params)))))

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def mixed_params() -> list[SamplingParams]:
    """Diffusion, AR and hybrid requests of different lengths and seeds, sampled at T=1."""
    modes = [DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID]
    return [
        SamplingParams(
            max_tokens=6 + 5 * i, mode=modes[i % 3], seed=i, temperature=1.0, max_denoising_steps=3
        )
        for i in range(6)
    ]


def test_overlapped_steps_give_the_serial_tokens_in_every_mode(tiny_checkpoint):
    path = tiny_checkpoint("c16")
    serial = serve(make_llm(path, overlapped=False), mixed_params())
    overlapped = serve(make_llm(path, overlapped=True), mixed_params())
    assert all(isinstance(t, list) and t for t in serial)
    assert overlapped == serial


def test_a_step_executes_while_the_last_steps_outputs_are_handed_over(tiny_checkpoint):
    """Each hand-over (a listener) waits for the next step's forward to have begun, and each
    forward waits for the last step's hand-over to have begun: possible only if they overlap
    (the serial loop would never hand step 0 over)."""
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True)
    execute = llm.engine.runner.execute
    forwards = [threading.Event() for _ in range(100)]  # forward i has begun
    handing = [threading.Event() for _ in range(100)]  # step i's hand-over has begun
    threads: set[str] = set()
    num_forwards, num_handed = [0], [0]

    def slow_execute(step: Any) -> Any:
        index = num_forwards[0]
        num_forwards[0] += 1
        forwards[index].set()
        if index > 0:
            assert handing[index - 1].wait(10), "the last step's hand-over did not begin"
        threads.add(threading.current_thread().name)
        return execute(step)

    def listener(stats: StepStats, outputs: Any) -> None:
        index = num_handed[0]
        num_handed[0] += 1
        handing[index].set()
        if index + 1 < expected_steps:
            assert forwards[index + 1].wait(10), "the next step did not begin"

    llm.engine.runner.execute = slow_execute  # type: ignore[method-assign]
    params = [SamplingParams(max_tokens=40, max_denoising_steps=3, seed=1)]
    expected_steps = len(serve_counting_steps(make_llm(tiny_checkpoint("c16"), False), params))
    tokens = serve(llm, params, lambda engine: engine.on_step.append(listener))
    assert isinstance(tokens[0], list) and len(tokens[0]) == 40
    assert num_handed[0] == expected_steps == num_forwards[0] > 3
    assert threads == {"canvas-step-loop"}  # the forward stays on the step loop's thread


def serve_counting_steps(llm: LLM, params: list[SamplingParams]) -> list[StepStats]:
    steps: list[StepStats] = []
    serve(llm, params, lambda engine: engine.on_step.append(lambda s, o: steps.append(s)))
    return steps


def test_exact_numerics_never_overlap(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True, exact=True)
    steps = overlap.StepPipeline(llm.engine, lambda result: None, overlap=True)
    assert llm.engine.config.overlap and not steps.overlap
    steps.close()


def test_aborts_and_arrivals_between_overlapped_steps(tiny_checkpoint):
    """A request cancelled mid-way ends and releases what it held; one sent later runs."""
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True)
    engine = AsyncEngine(llm.engine, gather=(0.0, 0.0), warmup=False)
    params = llm.validator.validate([5, 6, 7], SamplingParams(max_tokens=200, seed=3))
    short = llm.validator.validate([5, 6, 8], SamplingParams(max_tokens=8, seed=4))

    async def main() -> list[int]:
        engine.start(asyncio.get_running_loop())
        stream = engine.generate("long", [5, 6, 7], params)
        seen = 0
        async for out in stream:
            seen += len(out.new_token_ids)
            if seen:
                break
        await stream.aclose()  # the client went away: aborts it
        return [
            t async for out in engine.generate("late", [5, 6, 8], short) for t in out.new_token_ids
        ]

    try:
        late = asyncio.run(main())
        deadline = time.monotonic() + 10
        while llm.engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert len(late) == 8 and not llm.engine.requests
    assert llm.engine.pages.usage() == 0.0


def test_a_failing_overlapped_step_fails_only_its_rows(tiny_checkpoint, monkeypatch):
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True)
    inputs = llm.engine.inputs

    def faulty(rows: list[Any], canvas: Any = None) -> Any:
        if any(row.req.request_id == "r1" for row in rows):
            raise RuntimeError("injected")
        return inputs(rows, canvas)

    monkeypatch.setattr(llm.engine, "inputs", faulty)
    out = serve(llm, [SamplingParams(max_tokens=12, seed=i) for i in range(3)])
    assert isinstance(out[1], RuntimeError) and "internal engine error" in str(out[1])
    assert [len(t) for t in (out[0], out[2]) if isinstance(t, list)] == [12, 12]


def test_a_fatal_device_error_in_an_overlapped_step_stops_the_engine(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True)
    calls: list[int] = []

    def poisoned(step: Any) -> Any:
        calls.append(1)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    llm.engine.runner.execute = poisoned  # type: ignore[method-assign]
    holder: list[AsyncEngine] = []
    out = serve(llm, [SamplingParams(max_tokens=4, seed=i) for i in range(2)], holder.append)
    assert calls == [1] and all(isinstance(o, RuntimeError) for o in out)
    assert "GPU context is lost" in holder[0].stats.failure


class FakeEvent:
    """torch.cuda.Event on a CPU: records the host's clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def test_a_step_is_timed_by_cuda_events_without_a_synchronize(tiny_checkpoint, monkeypatch):
    """The runner's clock on the CUDA path (events faked on the host): a whole step runs with
    `torch.cuda.synchronize` forbidden, and its forward and sampler times come from events."""
    llm = make_llm(tiny_checkpoint("c16"), overlapped=False)
    made: list[overlap.ForwardClock] = []

    def cuda_clock(device: torch.device) -> overlap.ForwardClock:
        made.append(overlap.ForwardClock(torch.device("cuda")))
        return made[-1]

    def forbidden(*args: object) -> None:
        raise AssertionError("a step synchronized the device")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr("engine.runner.ForwardClock", cuda_clock)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, seed=2))
    assert len(out[0].output_ids) == 20 and made and all(c.cuda for c in made)
    params = llm.validator.validate([5, 6, 9], SamplingParams(max_tokens=4))
    llm.engine.add_request("x", [5, 6, 9], params)
    stats = llm.engine.step().stats
    assert stats.forward_seconds > 0 and stats.sample_seconds > 0
    assert stats.forward_seconds + stats.sample_seconds <= stats.step_seconds


def test_overlap_is_off_unless_the_flag_asks_for_it():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    overlap = lambda *flags: build_config(parser.parse_args(flags), None, ENGINE_FLAGS)  # noqa: E731
    assert overlap().engine.overlap is False and EngineConfig().overlap is False
    assert overlap("--overlap").engine.overlap is True


def denoising_params(n: int, steps: int = 5) -> list[SamplingParams]:
    """Diffusion requests that denoise a fixed number of steps per canvas (`steps`), 3 canvases
    each: most steps run the same rows as the step before."""
    return [
        SamplingParams(
            max_tokens=40,
            seed=i,
            temperature=1.0,
            max_denoising_steps=steps,
            confidence_threshold=0.0,
        )
        for i in range(n)
    ]


def counting_launches(llm: LLM) -> list[bool]:
    """Each forward's inputs (`Engine.inputs`), flagged True where its canvas came in (run
    ahead: the sampler's new state as it was sampled)."""
    launches: list[bool] = []
    inputs = llm.engine.inputs

    def counted(rows: list[Any], canvas: Any = None) -> Any:
        launches.append(canvas is not None)
        return inputs(rows, canvas)

    llm.engine.inputs = counted  # type: ignore[method-assign]
    return launches


@pytest.mark.parametrize("gathered", [False, True])
def test_denoising_steps_run_ahead_with_the_serial_tokens(tiny_checkpoint, monkeypatch, gathered):
    """Steps that go on denoising the same canvases run ahead (their forward starts from the
    sampler's new state while the last step is finished and the next one planned beside it),
    and give the serial loop's tokens and steps; their forward and sampler times exclude the
    wait for the hand-over thread. `gathered`: the new state gathered back from the slots once
    stored, as where the sampler's graphs replay (their outputs are not kept)."""
    if gathered:
        monkeypatch.setattr(overlap, "canvas_ahead", lambda sampling, num_rows: None)
    path = tiny_checkpoint("c16")
    serial_steps: list[StepStats] = []
    serial = serve(
        make_llm(path, overlapped=False),
        denoising_params(4),
        lambda engine: engine.on_step.append(lambda s, o: serial_steps.append(s)),
    )
    llm = make_llm(path, overlapped=True)
    launches = counting_launches(llm)
    steps: list[StepStats] = []
    pipelines: list[Any] = []

    threads: set[tuple[str, int]] = set()  # (thread, torch's threads there) of each hand-over

    def setup(engine: AsyncEngine) -> None:
        engine.on_step.append(lambda s, o: steps.append(s))
        engine.on_step.append(
            lambda s, o: threads.add(
                (threading.current_thread().name[:16], torch.get_num_threads())
            )
        )
        pipelines.append(engine._steps)

    overlapped = serve(llm, denoising_params(4), setup)
    assert threads == {("canvas-hand-over", 1)}  # no OpenMP team beside the step loop's
    assert all(isinstance(t, list) and len(t) == 40 for t in serial) and overlapped == serial
    assert [s.row_kinds for s in steps] == [s.row_kinds for s in serial_steps]
    pipeline = pipelines[0]
    # 3 canvases x 5 steps: each step but a canvas's first (riding with the prompt's last
    # chunk or the last canvas's commit) runs ahead
    assert pipeline.num_ahead == 12 and pipeline.num_dropped == 0
    assert sum(launches) == (0 if gathered else 12)
    assert sum(s.ran_ahead for s in steps) == 12 and not any(s.dropped_forwards for s in steps)
    assert len(launches) == len(steps)  # one forward per step: none run twice
    assert all(s.forward_seconds + s.sample_seconds <= s.step_seconds for s in steps)


def test_the_next_step_is_planned_while_a_forward_runs_ahead(tiny_checkpoint):
    """`Engine.begin` of step t+1 runs on the hand-over thread while step t+1's forward runs
    ahead: each such forward waits, before it returns, for that plan (in the serial loop the
    plan comes first, so nothing runs ahead)."""
    llm = make_llm(tiny_checkpoint("c16"), overlapped=True)
    engine, begun = llm.engine, threading.Event()
    begin, inputs, forward = engine.begin, engine.inputs, engine.forward
    waits: list[bool] = []
    ahead: list[bool] = [False]  # the inputs made last were a step's run ahead

    def planning(threads: int = 0) -> Any:
        began = begin(threads)
        if threading.current_thread().name.startswith("canvas-hand-over"):
            begun.set()
        return began

    def planned(rows: list[Any], canvas: Any = None) -> Any:
        ahead[0] = canvas is not None
        return inputs(rows, canvas)

    def launching(step: Any) -> Any:
        launched = forward(step)
        if ahead[0]:  # on the step loop's thread
            waits.append(begun.wait(10) and threading.current_thread().name == "canvas-step-loop")
            begun.clear()
        return launched

    engine.begin = planning  # type: ignore[method-assign]
    engine.inputs = planned  # type: ignore[method-assign]
    engine.forward = launching  # type: ignore[method-assign]
    out = serve(llm, denoising_params(2))
    assert all(isinstance(t, list) and len(t) == 40 for t in out)
    assert waits == [True] * 12


def test_a_step_whose_plan_changed_drops_the_forward_run_ahead(tiny_checkpoint):
    """A plan without the rows a forward ran ahead over (here a row held back by the
    scheduler once, in both loops) drops that forward and runs as planned: the serial loop's
    tokens, one forward more."""
    path = tiny_checkpoint("c16")

    def holding_back(engine: AsyncEngine) -> None:
        scheduler = engine.engine.scheduler
        schedule, calls = scheduler.schedule, [0]

        def plan() -> Any:
            calls[0] += 1
            out = schedule()
            if calls[0] == 4:  # mid-canvas: the last request waits a step
                assert len(out.rows) == 3 and not out.copies
                return replace(out, rows=out.rows[:-1])
            return out

        scheduler.schedule = plan  # type: ignore[method-assign]

    serial = serve(make_llm(path, overlapped=False), denoising_params(3), holding_back)
    llm = make_llm(path, overlapped=True)
    pipelines: list[Any] = []
    steps: list[StepStats] = []

    def setup(engine: AsyncEngine) -> None:
        holding_back(engine)
        pipelines.append(engine._steps)
        engine.on_step.append(lambda s, o: steps.append(s))

    overlapped = serve(llm, denoising_params(3), setup)
    assert all(isinstance(t, list) and len(t) == 40 for t in serial) and overlapped == serial
    assert pipelines[0].num_dropped == 1 and pipelines[0].num_ahead > 3
    assert [s.dropped_forwards for s in steps if s.dropped_forwards] == [1]


def test_canvas_ahead_is_what_canvas_inputs_gathers_after_the_write(tiny_checkpoint):
    """`BatchedSampling.canvas_ahead` gives `canvas_inputs`' tensors (values, dtypes) once the
    step's state is written, in bf16 too (the self-conditioning state is stored in the
    model's dtype: the new state is cast as the write casts it)."""
    for dtype in ("float32", "bfloat16"):
        llm = LLM.from_pretrained(tiny_checkpoint("c16"), dtype=dtype)
        engine = llm.engine
        for i, params in enumerate(denoising_params(3)):
            engine.add_request(
                f"r{i}", [5, 6, 7 + i], llm.validator.validate([5, 6, 7 + i], params)
            )
        engine.step()  # prompts, and each canvas's first step
        result = engine.step()  # all three canvases, mid-way
        assert result.stats.row_kinds == {"denoise": 3}
        ahead = overlap.canvas_ahead(engine.sampling, 3)  # type: ignore[arg-type]
        reqs = [engine.requests[f"r{i}"] for i in range(3)]
        gathered = engine.sampling.canvas_inputs(reqs, [False] * 3)
        assert ahead is not None and overlap.canvas_ahead(engine.sampling, 2) is None  # type: ignore[arg-type]
        for got, want in [(ahead.ids, gathered.ids), (ahead.soft, gathered.soft)]:
            assert got.dtype == want.dtype and torch.equal(got, want)
        for name in ("canvas_no", "canvas", "draft", "soft", "run", "steps_left", "num_steps"):
            got, want = getattr(ahead.state, name), getattr(gathered.state, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
    assert gathered.soft.dtype == torch.bfloat16


def test_a_denoising_step_of_the_same_rows_reuses_their_forward_batch(tiny_checkpoint):
    """The forward batch (positions, page tables in the bucket's buffers) is built once per
    canvas, not once per step; a changed page table (its version) builds it again."""
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    engine = llm.engine
    params = denoising_params(2)[0]
    engine.add_request("r", [5, 6, 7], llm.validator.validate([5, 6, 7], params))
    assert engine.step().stats.row_kinds == {"prefill": 1, "denoise": 1}
    placed = engine.runner.tables.steps  # the device tables placed: each batch built
    kinds = [engine.step().stats.row_kinds for _ in range(2)]
    assert engine.runner.tables.steps == placed + 1
    engine.requests["r"].pages.version += 1  # type: ignore[union-attr]
    kinds += [engine.step().stats.row_kinds for _ in range(2)]
    assert kinds == [{"denoise": 1}] * 4 and engine.runner.tables.steps == placed + 2


def test_a_step_whose_run_ahead_inputs_fail_runs_as_planned(tiny_checkpoint, monkeypatch):
    """Inputs of a step to run ahead that cannot be made: the step runs as the serial loop runs
    it (finished, then the next one begun and executed): the serial loop's tokens."""
    path = tiny_checkpoint("c16")
    serial = serve(make_llm(path, overlapped=False), denoising_params(2))
    llm = make_llm(path, overlapped=True)
    inputs = llm.engine.inputs

    def failing(rows: list[Any], canvas: Any = None) -> Any:
        if canvas is not None:
            raise RuntimeError("injected")
        return inputs(rows, canvas)

    monkeypatch.setattr(llm.engine, "inputs", failing)
    pipelines: list[Any] = []
    overlapped = serve(llm, denoising_params(2), lambda e: pipelines.append(e._steps))
    assert overlapped == serial and all(isinstance(t, list) and len(t) == 40 for t in serial)
    assert pipelines[0].num_ahead == 0 and pipelines[0].num_dropped == 0
    assert_nothing_held(llm)


def assert_nothing_held(llm: LLM) -> None:
    """Every request ended and released its KV pages and sampler slot."""
    engine = llm.engine
    assert not engine.requests and engine.pages.usage() == 0.0
    assert engine.scheduler.slots.num_free == engine.scheduler.slots.num_pages


def test_a_failing_forward_run_ahead_leaves_its_step_to_run_as_planned(tiny_checkpoint):
    """A forward run ahead that raises (not a fatal device error) is not kept: its step runs
    as planned, with the serial tokens, and every request releases what it held."""
    path = tiny_checkpoint("c16")
    serial = serve(make_llm(path, overlapped=False), denoising_params(2))
    llm = make_llm(path, overlapped=True)
    engine = llm.engine
    inputs, forward = engine.inputs, engine.forward
    ahead, raised = [False], [0]

    def planned(rows: list[Any], canvas: Any = None) -> Any:
        ahead[0] = canvas is not None  # only a step run ahead brings its canvas
        return inputs(rows, canvas)

    def failing(step: Any) -> Any:
        if ahead[0] and raised[0] < 2:
            raised[0] += 1
            raise RuntimeError("injected")
        return forward(step)

    engine.inputs = planned  # type: ignore[method-assign]
    engine.forward = failing  # type: ignore[method-assign]
    pipelines: list[Any] = []
    overlapped = serve(llm, denoising_params(2), lambda e: pipelines.append(e._steps))
    assert overlapped == serial and all(isinstance(t, list) and len(t) == 40 for t in serial)
    assert raised[0] == 2 and pipelines[0].num_ahead == 10 and pipelines[0].num_dropped == 0
    assert_nothing_held(llm)
