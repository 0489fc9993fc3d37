"""What a benchmark report says about the machine and its software, and the argument parsers
the benchmarks share."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any


def package_version(package: str) -> str | None:
    """The installed version of `package`, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def hardware() -> dict[str, Any]:
    """The CPU's model name, its core count and the platform."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def comma_ints(text: str) -> tuple[int, ...]:
    """argparse type: "1,4,16" -> (1, 4, 16); "" -> () (a part skipped)."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
