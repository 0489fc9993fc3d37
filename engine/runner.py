"""Model runner: turns a step's rows into tensors, runs one forward pass, returns logits.

It owns the model and the paged KV pools. DENOISE rows go first in the packed batch (their
canvas ids and self-conditioning inputs arrive as tensors from the sampler), then the ENCODE
rows (prompt chunks, commit passes, AR tokens, hybrid verify passes). It returns the logits the
sampler needs: every canvas position of the DENOISE rows, the last position of rows that end a
prompt in AR or hybrid mode or carry an AR token, and every position of a verify pass. Fast
numerics: one LM-head GEMM over all of them; exact numerics: the canvases in one GEMM and each
other position on its own (a one-row GEMM's rounding depends on the rows it shares, which
exact numerics never lets happen). Prompt chunks with image tokens take their images' soft tokens
from the vision tower (`engine.vision_cache`: one batch for the step's new images), which the
model merges into those tokens' embeddings.

Exact numerics run a verify pass as one-token rows, one per position, in the same forward:
every row writes its KV before any row attends, so position i reads position i-1's KV written
in the same layer, and each position goes through exactly the one-row GEMMs, attention and
head that an AR step at that position runs — its logits are AR's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from engine.device.ar_steps import ArSteps
from engine.device.cuda import to_device
from engine.device.graphs import Capture, ForwardGraphs, Hidden
from engine.device.overlap import ForwardClock
from engine.device.step_buffers import ForwardInputs
from engine.kv_pages import PageTables
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache
from engine.model.base import ImageEmbeds, SoftEmbeds
from engine.model.config import LayerType
from engine.model.kv_cache import DevicePageTables, Row
from engine.vision_cache import ImageTokens, VisionEncoder


@dataclass(frozen=True, slots=True)
class EncodeInput:
    """One ENCODE row: its tokens (a prompt chunk, a committed canvas, the last AR token)."""

    start: int  # position of the first token
    tokens: list[int]
    pages: PageTables
    wants_last_logits: bool  # the last position is sampled (AR)
    verify: bool = False  # a hybrid verify pass: the logits of every position are wanted
    images: ImageTokens | None = None  # a prompt chunk's image tokens
    # (first, last) positions of the chunk's images that attend both ways (`Row.spans`)
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What one forward pass runs: DENOISE rows (tensors from the sampler), then ENCODE rows."""

    denoise_starts: list[int]
    denoise_pages: list[PageTables]
    canvas_ids: torch.Tensor | None  # [R * L]
    soft_embeds: SoftEmbeds
    encode: list[EncodeInput]


@dataclass(frozen=True, slots=True)
class RunOutput:
    denoise_logits: torch.Tensor | None  # [R * L, V] fp32, DENOISE rows in input order
    last_logits: torch.Tensor | None  # [R_last, V] fp32, ENCODE rows wanting them, in order
    clock: ForwardClock  # the forward's and the sampler's times, read after sampling
    verify_logits: list[torch.Tensor] | None = None  # [n, V] per verify row, in order


class ModelRunner:
    def __init__(
        self,
        model: DiffusionLM,
        cache: PagedKVCache,
        max_rows: int = 1,
        graphs: Capture | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`max_rows`: the sequences expected to run at once (the device page tables' rows;
        they grow past it when a step needs more; the largest bucket of all-denoise steps,
        `engine.device.step_buffers`); `graphs`: replay their forwards (`engine.device.graphs`);
        `max_model_len`: the longest context served (the tables' width; None: the model's)."""
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.weight.device
        self.canvas_length = model.config.canvas_length
        max_pages = -(-(max_model_len or model.cfg.max_position_embeddings) // cache.page_size)
        self.tables = DevicePageTables(cache.layer_types, self.device, max_rows, max_pages)
        self.vision = VisionEncoder(model.vision, self.device) if model.vision is not None else None
        self.inputs = ForwardInputs(self.tables, model, cache.page_size, max_rows)
        self.graphs = ForwardGraphs(graphs, self.inputs, model, cache) if graphs else None
        self.ar = ArSteps(self.tables, model, cache, max_rows, graphs)  # all-AR steps' buckets

    @torch.inference_mode()
    def copy_sliding_pages(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy (source, destination) pages of every sliding layer's pool (values moved, not
        computed: exact in both numerics)."""
        self.cache.copy_pages(LayerType.SLIDING, [s for s, _ in copies], [d for _, d in copies])

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> RunOutput:
        """Fast numerics' all-denoise and all-AR steps of at most `max_rows` canvases (rows)
        take their inputs from persistent buffers (`engine.device.step_buffers`) and may replay
        a graph."""
        num_rows = len(step.denoise_starts)
        if (ar := self.ar.bucket(num_rows, step.encode)) is not None:  # engine.device.ar_steps
            return RunOutput(None, *self.ar.run(step.encode, ar))
        bucket = None if step.encode or self.model.kernels.exact else self.inputs.bucket(num_rows)
        replay = self.graphs if bucket is not None else None
        batch = self._batch(step, bucket)
        encode_ids = [t for e in step.encode for t in e.tokens]
        parts = [] if step.canvas_ids is None else [step.canvas_ids]
        if encode_ids:
            parts.append(to_device(np.array(encode_ids, dtype=np.int64), self.device))
        ids = torch.cat(parts) if len(parts) > 1 else parts[0]
        num_canvas = len(step.denoise_starts) * self.canvas_length
        offsets = self._encode_offsets(step, num_canvas)
        last = [o + len(e.tokens) - 1 for o, e in offsets if e.wants_last_logits and not e.verify]
        spans = [(o, len(e.tokens)) for o, e in offsets if e.verify]
        last += [i for first, n in spans for i in range(first, first + n)]
        # Every host-made tensor moves before the forward is queued: no copy inside it waits.
        batch.prepare(self.device, self.cache.layer_types)
        index = to_device(np.array(last, dtype=np.int64), self.device) if last else None
        clock = ForwardClock(self.device)
        if replay is not None:
            forward = replay.run(ids, step.soft_embeds, batch)
        else:
            images = self._image_embeds(offsets)
            hidden = self.model(ids, step.soft_embeds, batch, self.cache, images)  # [N, H]
            forward = hidden, self.model.logits
        denoise_logits, sampled = self._logits(forward, num_canvas, last, index)
        clock.stop()
        last_logits, verify_logits = sampled, None
        if spans:
            assert sampled is not None
            num_last = len(last) - sum(n for _, n in spans)
            last_logits = sampled[:num_last] if num_last else None
            verify_logits = list(sampled[num_last:].split([n for _, n in spans]))
        return RunOutput(denoise_logits, last_logits, clock, verify_logits)

    def _logits(
        self, forward: Hidden, num_canvas: int, last: list[int], index: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head over the canvases and the `last` positions (`index`: them on the device)."""
        hidden, head = forward
        if not last:
            return (head(hidden[:num_canvas]) if num_canvas else None), None
        if self.model.kernels.exact:
            denoise = head(hidden[:num_canvas]) if num_canvas else None
            return denoise, torch.stack([head(hidden[i]) for i in last])
        assert index is not None
        rows = torch.cat([hidden[:num_canvas], hidden[index]]) if num_canvas else hidden[index]
        logits = head(rows)  # one GEMM over every position that is sampled
        return (logits[:num_canvas] if num_canvas else None), logits[num_canvas:]

    def _image_embeds(self, offsets: list[tuple[int, EncodeInput]]) -> ImageEmbeds | None:
        """The soft tokens of the prompt chunks' image tokens, at their packed indices: the
        vision tower runs once over every image of the step that is not encoded yet."""
        rows = [(offset, e.images) for offset, e in offsets if e.images is not None]
        if not rows:
            return None
        assert self.vision is not None, "image tokens reach only a model with a vision tower"
        features = self.vision.features([tokens for _, tokens in rows])  # [M, H]
        index = [offset + i for offset, tokens in rows for i in tokens.index]
        return to_device(np.array(index, dtype=np.int64), self.device), features

    @staticmethod
    def _encode_offsets(step: StepInputs, first: int) -> list[tuple[int, EncodeInput]]:
        ends = list(accumulate((len(e.tokens) for e in step.encode), initial=first))
        return list(zip(ends[:-1], step.encode, strict=True))

    def _batch(self, step: StepInputs, bucket: int | None) -> ForwardBatch:
        """The step's rows, their page tables gathered from the device tables; in a `bucket`:
        from its buffers (padded to it for a graph)."""
        if bucket is not None:
            fill = self.graphs.batch if self.graphs is not None else self.inputs.batch
            return fill(step.denoise_starts, list(step.denoise_pages), bucket)
        length = self.canvas_length
        rows = [Row(Mode.DECODE, start, length, {}) for start in step.denoise_starts]
        held = list(step.denoise_pages)  # the page tables of each row, in row order
        split = self.model.kernels.exact  # verify passes as one-token rows (module docstring)
        for e in step.encode:
            if split and e.verify:
                rows += [Row(Mode.ENCODE, e.start + i, 1, {}) for i in range(len(e.tokens))]
                held += [e.pages] * len(e.tokens)
            else:
                rows.append(Row(Mode.ENCODE, e.start, len(e.tokens), {}, e.spans))
                held.append(e.pages)
        tables = self.tables.gather(held)
        return ForwardBatch(rows, self.model.cfg.sliding_window, self.cache.page_size, tables)
