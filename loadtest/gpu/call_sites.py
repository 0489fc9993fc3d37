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


def in_prepare() -> bool:
    """Inside `ForwardBatch.prepare`: the runner's inputs, moved before the forward is queued
    (the accountant cannot see where `ModelRunner.execute` starts queueing kernels)."""
    return any(
        f.name == "prepare" and f.filename.endswith("kv_cache.py")
        for f in traceback.extract_stack()
    )
