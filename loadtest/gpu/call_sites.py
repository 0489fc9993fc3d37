"""Where on the stack the accountant is called from: the project frame that made a host sync,
and whether the runner is still preparing its inputs."""

from __future__ import annotations

import traceback


def project_frame() -> str:
    """The innermost frame of the project (engine/, kernels/) on the stack: where a sync is."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        for root in ("/engine/", "/kernels/"):
            if root in path and "site-packages" not in path:
                return f"{root[1:]}{path.split(root, 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


def in_prepare(runner_calls: bool = False) -> bool:
    """Inside the runner's preparation of its inputs, before the forward is queued: its page
    tables (`ModelRunner._batch`) or `ForwardBatch.prepare`; with `runner_calls`, also an op
    that `ModelRunner.execute` calls itself (the host-made inputs it moves before the forward:
    the accountant cannot see where `execute` starts queueing kernels, so only host work)."""
    frames = [
        (f.filename.replace("\\", "/").rsplit("/", 1)[-1], f.name)
        for f in traceback.extract_stack()
        if "/engine/" in f.filename.replace("\\", "/") and "/engine/device/" not in f.filename
    ]
    if any(f in (("kv_cache.py", "prepare"), ("runner.py", "_batch")) for f in frames):
        return True
    return runner_calls and bool(frames) and frames[-1] == ("runner.py", "execute")
