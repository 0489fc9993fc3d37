"""Plot a training run's loss curve: `python -m engine.adapt.plot_loss OUT/loss_log.jsonl PNG`
(matplotlib, from the `bench` extra). Each step's loss, and its moving average."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(log: Path, png: Path, title: str = "canvas train --adapter", window: int = 25) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="loss per step")
    ax.plot(steps, moving_average(losses, window), lw=2, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("canvas cross-entropy (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    title = sys.argv[3] if len(sys.argv) > 3 else "canvas train --adapter"
    plot(Path(sys.argv[1]), Path(sys.argv[2]), title)
