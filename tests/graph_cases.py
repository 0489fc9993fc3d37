"""A stand-in for CUDA graph capture (`engine.device.graphs.Capture`) shared by the graph
tests: its replay runs the eager forward again, over whatever the bucket's buffers and batch
hold then, into the static output, so the padded, bucketed wiring runs without a graph."""

from __future__ import annotations

from collections.abc import Callable

import torch


class EagerCapture:
    def __init__(self) -> None:
        self.captured: list[int] = []  # rows of each captured forward, in capture order
        self.replays = 0

    def capture(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]:
        out = forward()
        self.captured.append(out.shape[0])

        def replay() -> None:
            self.replays += 1
            out.copy_(forward())

        return replay, out
