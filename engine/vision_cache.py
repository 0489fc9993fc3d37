"""The vision tower's work in a step: the soft tokens of the images whose tokens a step's prompt
chunks carry, computed in one batch over every image not computed yet (several requests'
images together) and kept by content hash for the next chunks of the same prompt, or another
request with the same image (a small LRU, bounded by count).

An image's soft tokens do not depend on the images it is batched with (every GEMM has at least
`max_patches` rows, attention and pooling are per image), which the tests check against the
reference bit for bit: so caching and cross-request batching change no result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from engine.device.cuda import to_device
from engine.inputs.images import PreparedImage
from engine.model.vision import VisionTower

CACHED_IMAGES = 32  # soft tokens kept for this many images (a few MB each on the real model)


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """The image tokens of one prompt chunk: the chunk's tokens at `index` (in the chunk) take
    soft tokens `first`, `first + 1`, ... of its request's `images` (their soft tokens in image
    order, as the reference's `masked_scatter` assigns them)."""

    images: tuple[PreparedImage, ...]
    first: int
    index: tuple[int, ...]

    def spans(self) -> list[tuple[PreparedImage, int, int]]:
        """(image, first soft token, end) of each image the chunk's tokens touch, in order."""
        lo, hi = self.first, self.first + len(self.index)
        out, offset = [], 0
        for image in self.images:
            end = offset + image.num_tokens
            if offset < hi and lo < end:
                out.append((image, max(lo, offset) - offset, min(hi, end) - offset))
            offset = end
        return out


class VisionEncoder:
    """Runs the vision tower for a step's image tokens (see the module docstring)."""

    def __init__(self, tower: VisionTower, device: torch.device) -> None:
        self.tower = tower
        self.device = device
        self.dtype = tower.projection.embedding_projection.weight.dtype
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        """Images whose soft tokens are kept."""
        return len(self._cache)

    def clear(self) -> None:
        """Forget every image's soft tokens (the warm-up leaves none behind)."""
        self._cache.clear()

    def features(self, chunks: list[ImageTokens]) -> torch.Tensor:
        """The soft tokens of every chunk's image tokens, chunk after chunk: [M, H]."""
        spans = [span for chunk in chunks for span in chunk.spans()]
        self._encode([image for image, _, _ in spans])
        parts = [self._cache[image.digest][lo:hi] for image, lo, hi in spans]
        for image, _, _ in spans:
            self._cache.move_to_end(image.digest)
        while len(self._cache) > max(CACHED_IMAGES, len(spans)):
            self._cache.popitem(last=False)
        return torch.cat(parts)

    def _encode(self, images: list[PreparedImage]) -> None:
        todo = list({i.digest: i for i in images if i.digest not in self._cache}.values())
        if not todo:
            return
        pixels = to_device(np.stack([i.pixel_values for i in todo]), self.device)
        positions = to_device(np.stack([i.position_ids for i in todo]), self.device)
        soft = self.tower(pixels, positions.long())  # [sum of soft tokens, H]
        for image, features in zip(todo, soft.split([i.num_tokens for i in todo]), strict=True):
            self._cache[image.digest] = features
