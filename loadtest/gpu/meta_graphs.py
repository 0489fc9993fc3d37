"""CUDA graphs on the meta device, for the roofline (`python -m loadtest.gpu.roofline
--cuda-graphs`): `MetaCapture` stands in for `engine.device.graphs.CudaCapture`, so the
engine's own graph wiring (`engine.device.graphs`, `engine.device.sampler_graphs`,
`engine.device.ar_steps`: which buckets, which work, which buffers) decides what a step
replays. A replay runs the captured function again under the accountant's `graph()` (one
launch for the graph; the kernels it holds keep their bytes and FLOPs but cost no launch);
meta tensors hold no values, so nothing is copied into the static outputs."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from engine.device.graphs import Outputs
from loadtest.gpu.accountant import Accountant


def active_accountant() -> Accountant | None:
    """The innermost accountant recording now, if any."""
    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, Accountant)]
    return modes[-1] if modes else None


class MetaCapture:
    """`engine.device.graphs.Capture` on the meta device (module docstring)."""

    def __init__(self) -> None:
        self.captured = 0  # functions captured (this capture's and those `apart` made)

    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        outs = forward()
        assert all(out.device.type == "meta" for out in outs), "a meta capture of meta tensors"
        self.captured += 1

        def replay() -> None:
            acct = active_accountant()
            if acct is None:
                forward()
                return
            with acct.graph():
                forward()

        return replay, outs

    def apart(self) -> MetaCapture:
        return self
