"""The roofline's figures where the docs print them: every row of `python -m
engine.parallel.roofline`'s tables stands verbatim in docs/parallelism.md (the communication
per step) or in the README's "Which GPU split to choose" (the step as a fraction of one GPU's),
and the sharded sampler's collectives carry nothing of vocabulary size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG
from engine.model.config import parse_text_config
from engine.parallel import roofline

ROOT = Path(__file__).parents[2]


def printed_rows(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], list[str]]:
    """The table rows (not headers) of the roofline's output: (communication, summary)."""
    roofline.main()
    table, summary = capsys.readouterr().out.split("\n\n", 1)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    tp = [line for line in summary.splitlines() if line.startswith("| TP=")]
    return rows[1:], tp


def test_the_docs_print_the_rooflines_figures(capsys: pytest.CaptureFixture[str]) -> None:
    rows, summary = printed_rows(capsys)
    assert len(rows) == 6 and len(summary) == 4
    doc = (ROOT / "docs" / "parallelism.md").read_text()
    assert all(row in doc.splitlines() for row in rows)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Which GPU split to choose") :]
    assert all(row in section.splitlines() for row in summary)


def test_the_sharded_step_moves_no_logits_and_the_fused_one_fewer_calls() -> None:
    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    bigger = dataclasses.replace(cfg, vocab_size=2 * cfg.vocab_size)
    for size in (2, 4):
        sharded = roofline.denoise_step(cfg, 16, size, sharded_sampler=True)
        assert sharded == roofline.denoise_step(bigger, 16, size, sharded_sampler=True)
        gathered = roofline.denoise_step(cfg, 16, size, sharded_sampler=False)
        assert gathered.all_gather_bytes == 16 * 256 * cfg.vocab_size * 2
        fused = roofline.denoise_step(cfg, 16, size, sharded_sampler=True, fused_ffn=True)
        assert fused.all_reduce_bytes == sharded.all_reduce_bytes
        assert fused.all_reduce_calls == sharded.all_reduce_calls - cfg.num_layers
