"""Rank 0's sampling over a vocabulary-parallel model: `ShardedSampling` is the engine's fast
sampler (`engine.sampling.BatchedSampling`: its slots, Philox streams and canvas inputs stay
rank 0's), but the sampler's kernels run on every rank over its slice of the LM head
(`engine.parallel.step.Leader.sample`): rank 0 sends each call's rows of the head, the
requests' logits processors (`RowEdit`), the temperatures and uniform numbers, and reads the
picked ids, the entropies and the soft embedding that every rank computes alike.

Most rows never exist whole on any rank. A row is all-gathered at the head (`Leader.full_rows`,
chosen here before each step's head from the step's layout) only when a feature reads the whole
row on rank 0:
- log-probabilities of an AR token (the chosen token's, the top k: `engine.logprobs` over the
  raw row);
- top_k / top_p / min_p (a threshold over the whole row);
- a hybrid verify pass (speculative acceptance over the whole distribution).
A converged canvas's rows are gathered after its last step is sampled (`Leader.gather`), when
its log-probabilities are wanted or its grammar repairs it (position by position, from its
rows): the steps before it gather nothing.
An AR row's grammar needs no whole row: the engine masks rank 0's row (-inf outside the
grammar, over its columns and the NaN of the others'), and rank 0 sends the allowed tokens it
reads there (a bit per token, as for the filters' mask) for every rank to mask its columns;
logit_bias and the penalties act per token and every rank applies them to its own columns
(`engine.parallel.sampler.apply_edits_`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.batched_sampler import to_host
from engine.device.cuda import to_device
from engine.logits.processors import filters, penalises, process_, token_counts
from engine.parallel.sampler import RowEdit, apply_edits_, pack_mask
from engine.parallel.step import Leader, vocab_start
from engine.request import RequestState
from engine.runner import RunOutput, StepInputs
from engine.sampling import BatchedSampling, CanvasBatch, CanvasSample, TokenSample
from kernels.reference import SampleResult

if TYPE_CHECKING:
    from engine.engine import Engine

CANVAS, TOKEN, VERIFY = "canvas", "token", "verify"  # what a request's rows of the head are


def layout(step: StepInputs, canvas_length: int) -> dict[int, tuple[int, int, str]]:
    """Where each request's rows lie in the step's LM-head output, keyed by `id` of its page
    tables (each request's own object): (first row, rows, what they are). The runner's order
    (`engine.runner.ModelRunner.execute`): the canvases, then the ENCODE rows' last positions,
    then the verify passes' positions."""
    out, row = {}, 0
    for pages in step.denoise_pages:
        out[id(pages)] = (row, canvas_length, CANVAS)
        row += canvas_length
    for e in step.encode:
        if e.wants_last_logits and not e.verify:
            out[id(e.pages)] = (row, 1, TOKEN)
            row += 1
    for e in step.encode:
        if e.verify:
            out[id(e.pages)] = (row, len(e.tokens), VERIFY)
            row += len(e.tokens)
    return out


def reads_whole_rows(req: RequestState, what: str) -> bool:
    """Whether rank 0 reads `req`'s rows of this kind whole (the module docstring's list)."""
    params = req.params
    if what == VERIFY or filters(params):
        return True
    if what == CANVAS:  # a converged canvas's rows are gathered once sampled: `read_late`
        return False
    return params.logprobs is not None


def read_late(req: RequestState) -> bool:
    """Whether `req`'s canvas rows are read whole once it converged (`engine.postprocess`:
    a committed canvas's log-probabilities and grammar repair), and not gathered already."""
    wanted = req.params.logprobs is not None or req.constraint is not None
    return wanted and req.policy.commits_drafts() and not filters(req.params)


def masks(req: RequestState, what: str) -> bool:
    """Whether `req`'s sampled rows take an allowed-token mask: the filters', and an AR
    row's grammar's (which the engine applies to rank 0's row before sampling)."""
    return filters(req.params) or (what == TOKEN and req.constraint is not None)


def edit_of(req: RequestState, first: int, rows: torch.Tensor, what: str) -> RowEdit | None:
    """`req`'s processors over rows [first, first + len(rows)) of a sampling call (None: it
    has none); `rows`: its logits as the engine passes them (whole where the filters are on;
    a grammar's -inf in them)."""
    params, device = req.params, rows.device
    fields: dict[str, object] = {}
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        fields["bias_ids"] = to_device(np.array(ids, dtype=np.int64), device)
        fields["biases"] = to_device(np.array(biases, dtype=np.float32), device)
    if penalises(params):
        fields["counts"] = token_counts(req, device)
        for name in ("repetition", "frequency", "presence"):
            value = getattr(params, f"{name}_penalty")
            fields[name] = torch.tensor([value], dtype=torch.float32, device=device)
    if masks(req, what):
        whole = rows.clone()  # a grammar's -inf are in it already (NaN is not -inf)
        if filters(params):
            process_(whole, req)  # the filters' threshold is over the processed row
        fields["allowed"] = pack_mask(~torch.isneginf(whole))
    return RowEdit(first, rows.shape[0], **fields) if fields else None  # type: ignore[arg-type]


class ShardedSampling(BatchedSampling):
    """`BatchedSampling` whose sampler kernels run on every rank (module docstring). `watch`
    makes it choose each step's gathered rows; it samples from rank 0's slice of the head."""

    def __init__(self, engine: Engine, leader: Leader) -> None:
        model = engine.model
        super().__init__(model, engine.scheduler.config.max_num_seqs, None)  # no graphs at TP
        self.engine, self.leader = engine, leader
        self.start, self.vocab = vocab_start(model), model.cfg.vocab_size
        sampler = self.sampler
        sampler.vocab_size = self.vocab  # fresh canvases draw from the whole vocabulary
        sampler.kernels = dataclasses.replace(
            model.kernels, fused_sample=self._fused_sample, sample_and_embed=self._sample_and_embed
        )
        self.rows: dict[int, tuple[int, int, str]] = {}  # this step's `layout`
        self.call: tuple[torch.Tensor, list[RowEdit]] | None = None

    def watch(self) -> None:
        """Before each forward, learn the step's layout and set the rows gathered whole."""
        runner = self.engine.runner
        execute = runner.execute

        def run(step: StepInputs) -> RunOutput:
            self.rows = layout(step, self.canvas_length)
            running = {id(r.pages): r for r in self.engine.scheduler.running.values()}
            whole = [
                range(first, first + count)
                for key, (first, count, what) in self.rows.items()
                if reads_whole_rows(running[key], what)
            ]
            self.leader.full_rows = sorted(i for r in whole for i in r)
            return execute(step)

        object.__setattr__(runner, "execute", run)

    # -- the engine's calls -------------------------------------------------------------------

    def sample_canvases(
        self, canvas: CanvasBatch, logits: torch.Tensor, reqs: list[RequestState]
    ) -> CanvasSample:
        """The converged canvases that are read whole (`read_late`) get their rows of
        `logits` (what the engine reads after sampling) gathered."""
        length = self.canvas_length
        sampled = super().sample_canvases(canvas, self._local(logits, reqs, length), reqs)
        late = [
            j
            for j, req in enumerate(reqs)
            if sampled.finished[j] and not sampled.failed[j] and read_late(req)
        ]
        if late:
            firsts = [self.rows[id(reqs[j].pages)][0] for j in late]
            whole = self.leader.gather([f + i for f in firsts for i in range(length)])
            ours = [j * length + i for j in late for i in range(length)]
            with torch.inference_mode():  # the step's logits are inference tensors
                logits[to_device(np.array(ours, dtype=np.int64), logits.device)] = whole
        return sampled

    def sample_tokens(self, logits: torch.Tensor, reqs: list[RequestState]) -> TokenSample:
        local = self._local(logits, reqs, 1)
        slots = [r.slot for r in reqs]
        index = [len(r.output_ids) for r in reqs]
        drawn = self.sampler.sample_ar(
            local,
            to_device(np.array(slots, dtype=np.int64), self.device),
            to_device(np.array(index, dtype=np.int64), self.device),
        )  # never `all_greedy`: its argmax would be rank 0's slice's
        tokens, failed = to_host(drawn)
        return TokenSample(tokens, [bool(f) for f in failed])

    @contextmanager
    def _processing(
        self, logits: torch.Tensor, slots: torch.Tensor, reqs: list[RequestState], length: int
    ) -> Iterator[None]:
        yield  # `_local` has processed rank 0's slice, and the followers process theirs

    # -- the sharded kernels ------------------------------------------------------------------

    def _local(self, logits: torch.Tensor, reqs: list[RequestState], length: int) -> torch.Tensor:
        """Rank 0's processed slice [R * length, V_0] of `reqs`' rows of the head; the rows
        and edits are kept for the sampler call that follows."""
        rows: list[int] = []
        edits = []
        for k, req in enumerate(reqs):
            first, count, what = self.rows[id(req.pages)]
            assert count == length and what in (CANVAS, TOKEN), "sampled rows are the head's"
            rows.extend(range(first, first + count))
            edit = edit_of(req, k * length, logits[k * length : (k + 1) * length], what)
            if edit is not None:
                edits.append(edit)
        assert self.leader.local is not None, "the head ran"
        index = to_device(np.array(rows, dtype=np.int64), self.device)
        local = self.leader.local[index]  # a copy: the edits write it
        apply_edits_(local, self.start, self.vocab, edits)
        self.call = (index, edits)
        return local

    def _take_call(self) -> tuple[torch.Tensor, list[RowEdit]]:
        assert self.call is not None, "sampled without `_local`"
        call, self.call = self.call, None
        return call

    def _fused_sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
    ) -> SampleResult:
        rows, edits = self._take_call()
        return self.leader.sample(rows, edits, logits, temperature, uniform)[0]

    def _sample_and_embed(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
        weight: torch.Tensor,
        scale: float,
    ) -> tuple[SampleResult, torch.Tensor]:
        rows, edits = self._take_call()
        result, soft = self.leader.sample(rows, edits, logits, temperature, uniform, weight, scale)
        assert soft is not None
        return result, soft
