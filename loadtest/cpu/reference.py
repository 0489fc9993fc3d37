"""The transformers reference, served the way someone without Canvas would serve it.

Diffusion: `DiffusionGemmaForBlockDiffusion.generate()` either one request at a time, or in
static batches: requests grouped in arrival order, left-padded to the longest prompt, with an
attention mask. AR: the reference class has no AR `generate()`, so `greedy_ar` is the plain
loop anyone would write over the same checkpoint's encoder and LM head (soft-capped logits,
argmax, one token per pass, a `DynamicCache`), one request at a time or in static batches.
The reference masks padded keys in both the encoder and the canvas decoder; a padded row's
positions are shifted by its padding, which rotary attention does not see (only relative
positions matter), so a padded row decodes like the same prompt alone.

Budgets match Canvas runs with `ignore_eos` and `confidence_threshold=0`: EOS is switched off
(`eos_token_id=None`, so every request gets its whole budget), and the adaptive stop is made
unreachable with a tiny positive threshold (the reference requires > 0). Every decoder pass
is counted, so the records show whether each canvas really ran the fixed number of steps, and
timed (module hooks on the encoder, decoder and LM head; the denoising step wrapped), so each
run reports its step as forward, sampler and the rest, as Canvas' metrics do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.load.stats import EngineOverhead, RequestRecord, gaps

logger = logging.getLogger(__name__)
UNREACHABLE_CONFIDENCE = 1e-30  # the stop needs mean entropy below it: never, before the cap
Prompts = Sequence[tuple[str, list[int]]]  # (prompt name, token ids), in arrival order


@dataclass(frozen=True, slots=True)
class ReferenceSettings:
    max_new_tokens: int  # requests keep this many tokens; the reference computes whole canvases
    max_denoising_steps: int
    seed: int = 0  # request i runs after torch.manual_seed(seed + i), as Canvas' `seed` does
    confidence_threshold: float = UNREACHABLE_CONFIDENCE


@dataclass(slots=True)
class _Clock:
    """Streamer, module hooks and step wrapper in one: times each committed canvas (each token
    in AR), counts decoder passes and sums the time in the forward and in the sampler.
    generate() first puts the prompt, then each committed canvas."""

    passes: int = 0
    steps: int = 0  # denoising steps (AR: encoder passes), each over the whole batch
    prompt_seen: bool = False
    canvas_times: list[float] = field(default_factory=list)
    canvas_passes: list[int] = field(default_factory=list)
    forward_seconds: float = 0.0  # encoder, decoder and LM head
    denoise_forward_seconds: float = 0.0  # of which inside the denoising steps
    denoise_seconds: float = 0.0  # whole denoising steps: their forward and the sampler
    _entered: float = 0.0

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.canvas_times.append(time.perf_counter())
        self.canvas_passes.append(self.passes)

    def end(self) -> None:
        pass

    def on_decoder(self, *_: Any) -> None:
        self.passes += 1

    def enter_forward(self, *_: Any) -> None:
        self._entered = time.perf_counter()

    def leave_forward(self, *_: Any) -> None:
        self.forward_seconds += time.perf_counter() - self._entered

    def overhead(self, wall_seconds: float) -> EngineOverhead:
        """The step breakdown of a run: sampler = the denoising steps outside their forward;
        the rest (Python, the commit bookkeeping) is what remains of the wall time."""
        return EngineOverhead(
            num_steps=self.steps,
            step_seconds=wall_seconds,
            forward_seconds=self.forward_seconds,
            sample_seconds=max(0.0, self.denoise_seconds - self.denoise_forward_seconds),
        )


def load_reference(model_dir: Path, dtype: str = "float32") -> Any:
    """The transformers model of `model_dir` in `dtype` (a torch dtype's name), for inference."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


@contextmanager
def _timed(model: Any, clock: _Clock) -> Iterator[None]:
    """Hooks on the forward's modules and a timing wrapper around the denoising step (an
    instance attribute shadowing the method), all removed on exit."""
    modules = (model.model.encoder, model.model.decoder, model.lm_head)
    handles = [model.model.decoder.register_forward_hook(clock.on_decoder)]
    for module in modules:
        handles.append(module.register_forward_pre_hook(clock.enter_forward))
        handles.append(module.register_forward_hook(clock.leave_forward))
    step = model._denoising_step

    def denoising_step(*args: Any, **kwargs: Any) -> Any:
        began, forward = time.perf_counter(), clock.forward_seconds
        try:
            return step(*args, **kwargs)
        finally:
            clock.steps += 1
            clock.denoise_seconds += time.perf_counter() - began
            clock.denoise_forward_seconds += clock.forward_seconds - forward

    model._denoising_step = denoising_step
    try:
        yield
    finally:
        del model._denoising_step
        for handle in handles:
            handle.remove()


def _generate(
    model: Any, ids: Any, mask: Any, settings: ReferenceSettings, clock: _Clock
) -> tuple[Any, _Clock]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "max_denoising_steps": settings.max_denoising_steps,
        "confidence_threshold": settings.confidence_threshold,
        "eos_token_id": None,
        "streamer": clock,
    }
    if mask is not None:
        kwargs["attention_mask"] = mask
    with _timed(model, clock):
        sequences = model.generate(ids, **kwargs).sequences
    return sequences, clock


def greedy_ar(
    model: Any,
    ids: Any,
    mask: Any | None,
    max_new_tokens: int,
    eos_token_ids: frozenset[int] = frozenset(),
    clock: _Clock | None = None,
) -> list[list[int]]:
    """The reference's AR path: greedy decoding over the encoder's soft-capped LM-head logits
    with a KV cache, one token per pass for every row of `ids` ([rows, prompt_len], left-padded
    where `mask` has zeros). A row ends after an id of `eos_token_ids` or `max_new_tokens`; the
    loop ends when every row has. Returns each row's new ids; `clock` gets a put per token."""
    import torch
    from transformers import DynamicCache

    clock = clock or _Clock(prompt_seen=True)
    cap = model.config.get_text_config(decoder=True).final_logit_softcapping
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    rows, pos = ids.shape[0], 0
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    with torch.inference_mode():
        while not all(done):
            n = ids.shape[1]
            positions = torch.arange(pos, pos + n).expand(rows, n)  # [rows, n]
            began = time.perf_counter()
            hidden = model.model.encoder(
                input_ids=ids, attention_mask=mask, cache=cache, position_ids=positions
            ).last_hidden_state
            logits = model.lm_head(hidden[:, -1]).float()  # [rows, vocab]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            sampled = time.perf_counter()
            tokens = logits.argmax(-1).tolist()
            clock.denoise_seconds += time.perf_counter() - sampled  # AR: the sampler is argmax
            clock.forward_seconds += sampled - began
            clock.steps += 1
            for row, token in enumerate(tokens):
                if not done[row]:
                    out[row].append(token)
                    done[row] = token in eos_token_ids or len(out[row]) == max_new_tokens
            clock.put(tokens)
            pos += n
            ids = torch.tensor(tokens)[:, None]  # [rows, 1]
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)  # [rows, pos]
    return out


def _records(
    batch: Sequence[tuple[int, str, list[int]]],
    clock: _Clock,
    generated: int,
    started: float,
    finished: float,
    settings: ReferenceSettings,
    run_start: float,
) -> list[RequestRecord]:
    """One record per request of a generate() call (all rows share its timing)."""
    times, passes = clock.canvas_times, [0, *clock.canvas_passes]
    tokens = min(settings.max_new_tokens, generated)
    ar = clock.passes == 0  # AR: one encoder pass (a "canvas" of one token) per token
    return [
        RequestRecord(
            index=index,
            prompt_name=name,
            start=started - run_start,
            latency=finished - started,
            ttft=times[0] - started if times else None,
            canvas_seconds=gaps(times),
            prompt_tokens=len(ids),
            output_tokens=tokens,
            finish_reason="length",
            steps_per_canvas=() if ar else tuple(int(n) for n in gaps(passes)),
            decoder_passes=clock.passes,
            tokens_per_forward=1.0 if ar else tokens / clock.passes if clock.passes else None,
        )
        for index, name, ids in batch
    ]


# (model, padded ids, mask or None, settings, clock) -> new tokens per row
Decode = Callable[[Any, Any, Any, ReferenceSettings, _Clock], int]


def _diffusion(model: Any, ids: Any, mask: Any, settings: ReferenceSettings, clock: _Clock) -> int:
    sequences, _ = _generate(model, ids, mask, settings, clock)
    return int(sequences.shape[1] - ids.shape[1])


def _ar(model: Any, ids: Any, mask: Any, settings: ReferenceSettings, clock: _Clock) -> int:
    clock.prompt_seen = True
    out = greedy_ar(model, ids, mask, settings.max_new_tokens, clock=clock)
    return min(len(row) for row in out)


DECODERS: dict[str, Decode] = {"diffusion": _diffusion, "ar": _ar}


def run_static_batches(
    model: Any,
    prompts: Prompts,
    batch_size: int,
    settings: ReferenceSettings,
    pad_token_id: int,
    mode: str = "diffusion",
) -> tuple[list[RequestRecord], float, EngineOverhead]:
    """Batches of `batch_size` requests in order, left-padded (batch size 1: one request at a
    time, unpadded), decoded in `mode` ("diffusion": generate(); "ar": `greedy_ar`). A
    request's latency is its batch's time (all requests of a batch are taken to arrive
    together). Returns the records, the run's wall time and its step breakdown."""
    import torch

    records: list[RequestRecord] = []
    totals = _Clock()
    run_start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        group = [
            (first + k, n, ids) for k, (n, ids) in enumerate(prompts[first : first + batch_size])
        ]
        width = max(len(ids) for _, _, ids in group)
        padded = [[pad_token_id] * (width - len(ids)) + ids for _, _, ids in group]
        mask = [[0] * (width - len(ids)) + [1] * len(ids) for _, _, ids in group]
        torch.manual_seed(settings.seed + first)
        clock = _Clock()
        started = time.perf_counter()
        generated = DECODERS[mode](
            model,
            torch.tensor(padded),
            torch.tensor(mask) if batch_size > 1 else None,
            settings,
            clock,
        )
        finished = time.perf_counter()
        records += _records(group, clock, generated, started, finished, settings, run_start)
        totals.steps += clock.steps
        totals.forward_seconds += clock.forward_seconds
        totals.denoise_seconds += clock.denoise_seconds
        totals.denoise_forward_seconds += clock.denoise_forward_seconds
    wall = time.perf_counter() - run_start
    return records, wall, totals.overhead(wall)
