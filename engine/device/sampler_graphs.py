"""CUDA graphs of the fast sampler's device work in all-denoise steps (`--cuda-graphs`): per
bucket of at most `HEAD_ROWS` canvases, whose forward graph also runs the LM head
(`engine.device.graphs`), three graphs replace the sampler's eager launches:

- the canvas inputs (`BatchedSampler.canvas_inputs`): over the bucket's persistent slots and
  new-canvas flags (`engine.device.step_buffers.SamplerInputs`, dummy rows at slot 0, not
  starting), into static row states, the ids and self-conditioning inputs written straight
  into the forward graph's static inputs (`ForwardGraphs.static_inputs`);
- the update (`BatchedSampler.denoise`): over the forward graph's static logits (which the
  logits processors, if any, have rewritten in place before) and those row states, into static
  new row states and results;
- the state write (`BatchedSampler.write`), once the step has succeeded, where every row is
  kept and the bucket has no dummy row (a dummy's slot is a real request's).

Every per-row value they read sits in a persistent buffer (the slots' state and parameters in
`SlotState`: Philox seeds, canvas numbers, steps, temperatures, thresholds are gathered from it
by slot inside the graph), so a replay allocates nothing, copies nothing from the host and waits
for nothing. The caller gets views of the static outputs' first R rows; the dummy rows' are
dropped. The graphs have a memory pool of their own (`Capture.apart`): the forward graph of the
bucket replays between the first two, and in a shared pool its scratch memory could be where
the first one's outputs live. Each is captured at its bucket's first step that can replay it.

Anything else runs eager, as without graphs: rows with a pinned first token (hybrid), larger
buckets, mixed steps (their logits are not the graph's), exact numerics (another sampler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from engine.batched_sampler import BatchedSampler, RowStates
from engine.device.graphs import HEAD_ROWS, ForwardGraphs, Outputs
from engine.device.step_buffers import SamplerInputs, bucket_of

_FIELDS = tuple(f.name for f in fields(RowStates))


def _flat(rows: RowStates) -> Outputs:
    return tuple(getattr(rows, name) for name in _FIELDS)


def _rows(flat: Outputs, num: int) -> RowStates:
    """The first `num` rows of flattened row states."""
    return RowStates(*(t[:num] for t in flat))


@dataclass(slots=True)
class _Pair:
    replay_inputs: Callable[[], None]
    inputs: Outputs  # ids [B * L], soft [B * L, H], then the row states' fields
    replay_update: Callable[[], None] | None = None
    update: Outputs = ()  # the new row states' fields, then the results (`denoise`)
    replay_write: Callable[[], None] | None = None


class SamplerGraphs:
    """`BatchedSampler.canvas_inputs`, `denoise` and `write` as replayed graphs where they can
    be (module docstring), else the sampler's own."""

    def __init__(
        self, forward: ForwardGraphs, sampler: BatchedSampler, inputs: SamplerInputs
    ) -> None:
        """`forward`: the runner's graphs (their capture and logits); `inputs`: the staging
        of the slots and flags that `canvas_inputs` is given."""
        self.forward, self.sampler, self.staged = forward, sampler, inputs
        self.capturer = forward.capturer.apart()
        self.pairs: dict[int, _Pair] = {}

    @torch.inference_mode()  # their buffers are the forward graphs' (inference tensors)
    def canvas_inputs(
        self, slots: torch.Tensor, starting: torch.Tensor, pinned: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, RowStates]:
        """`BatchedSampler.canvas_inputs`; `slots` and `starting`: what `SamplerInputs.stage`
        gave for the step."""
        num = slots.shape[0]
        bucket = bucket_of(num, self.staged.sizes)
        if pinned is not None or bucket is None or bucket > HEAD_ROWS:
            return self.sampler.canvas_inputs(slots, starting, pinned)
        full_slots, full_flags = self.staged.buffers(bucket)
        assert full_slots.data_ptr() == slots.data_ptr(), "slots staged elsewhere"
        pair = self.pairs.get(bucket)
        if pair is None:  # a capture computes nothing on CUDA: the replay below does
            into = self.forward.static_inputs(bucket)
            replay, outs = self.capturer.capture(lambda: self._inputs(full_slots, full_flags, into))
            pair = self.pairs[bucket] = _Pair(replay, outs)
        pair.replay_inputs()
        length = self.sampler.canvas_length
        ids, soft, *rows = pair.inputs
        return ids[: num * length], soft[: num * length], _rows(tuple(rows), num)

    def _inputs(self, slots: torch.Tensor, flags: torch.Tensor, into: Outputs) -> Outputs:
        """The canvas inputs, the ids and soft inputs written into the forward graph's (`into`)."""
        ids, soft, rows = self.sampler.canvas_inputs(slots, flags)
        static_ids, static_soft = into
        static_ids.copy_(ids)
        static_soft.copy_(soft)
        return (static_ids, static_soft, *_flat(rows))

    @torch.inference_mode()  # their buffers are the forward graphs' (inference tensors)
    def denoise(
        self, logits: torch.Tensor, rows: RowStates
    ) -> tuple[RowStates, list[torch.Tensor]]:
        """`BatchedSampler.denoise`, replayed where `logits` are a bucket's graph's and `rows`
        its canvas inputs' (views of their first rows)."""
        num = rows.slots.shape[0]
        bucket = bucket_of(num, self.staged.sizes)
        pair = self.pairs.get(bucket) if bucket is not None else None
        static = self.forward.logits(bucket) if bucket is not None else None
        if pair is None or static is None or logits.data_ptr() != static.data_ptr():
            return self.sampler.denoise(logits, rows)
        if any(
            a.data_ptr() != b.data_ptr() for a, b in zip(_flat(rows), pair.inputs[2:], strict=True)
        ):
            return self.sampler.denoise(logits, rows)  # eager canvas inputs (a pinned token)
        if pair.replay_update is None:
            full = _rows(pair.inputs[2:], pair.inputs[2].shape[0])
            replay, pair.update = self.capturer.capture(lambda: self._update(static, full))
            pair.replay_update = replay
        pair.replay_update()
        length, width = self.sampler.canvas_length, len(_FIELDS)
        new, (finished, steps, drafts, failed) = pair.update[:width], pair.update[width:]
        return _rows(new, num), [finished[:num], steps[:num], drafts[: num * length], failed[:num]]

    @torch.inference_mode()  # their buffers are the forward graphs' (inference tensors)
    def write(self, rows: RowStates, keep: torch.Tensor | None = None) -> None:
        """`BatchedSampler.write`, replayed where every row of a full bucket is kept and `rows`
        are its update's (a bucket with dummy rows writes the real ones eager: the dummies'
        slot is a real request's)."""
        bucket = rows.slots.shape[0]
        pair = self.pairs.get(bucket)
        if keep is not None or pair is None or pair.replay_update is None:
            return self.sampler.write(rows, keep)
        new = pair.update[: len(_FIELDS)]
        if pair.inputs[2].shape[0] != bucket or any(
            a.data_ptr() != b.data_ptr() for a, b in zip(_flat(rows), new, strict=True)
        ):
            return self.sampler.write(rows, keep)
        if pair.replay_write is None:
            full = _rows(new, bucket)
            pair.replay_write, _ = self.capturer.capture(lambda: self._write(full))
        pair.replay_write()

    def _write(self, rows: RowStates) -> Outputs:
        self.sampler.write(rows)
        return ()

    def _update(self, logits: torch.Tensor, rows: RowStates) -> Outputs:
        new, results = self.sampler.denoise(logits, rows)
        return (*_flat(new), *results)
