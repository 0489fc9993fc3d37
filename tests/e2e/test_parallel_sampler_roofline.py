"""The roofline's figures where the docs print them: every row of `python -m
engine.parallel.roofline`'s tables stands verbatim in docs/parallelism.md (the communication
per step) or in the README's "Which GPU split to choose" (the step as a fraction of one GPU's),
the sharded sampler's collectives carry nothing of vocabulary size, and the overlapped dense-MLP
all-reduce costs only what it outlasts the experts by."""

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


def test_the_sharded_step_moves_no_logits() -> None:
    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    bigger = dataclasses.replace(cfg, vocab_size=2 * cfg.vocab_size)
    for size in (2, 4):
        sharded = roofline.denoise_step(cfg, 16, size, sharded_sampler=True)
        assert sharded == roofline.denoise_step(bigger, 16, size, sharded_sampler=True)
        gathered = roofline.denoise_step(cfg, 16, size, sharded_sampler=False)
        assert gathered.all_gather_bytes == 16 * 256 * cfg.vocab_size * 2


def test_the_overlapped_all_reduce_costs_what_it_outlasts_the_experts_by() -> None:
    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    nvlink, pcie = roofline.LINKS
    for size in (2, 4):
        for canvases in roofline.H100_DENOISE_MS:
            tokens = canvases * roofline.CANVAS
            work = roofline.denoise_step(cfg, canvases, size, sharded_sampler=True)
            one = roofline.Collectives(tokens * cfg.hidden_size * 2, 1)  # [tokens, H] bf16
            assert work.started_calls == cfg.num_layers
            assert work.started_bytes == cfg.num_layers * one.all_reduce_bytes
            experts = roofline.experts_seconds(cfg, tokens, size)
            for link in (nvlink, pcie):
                exposed = roofline.exposed_seconds(cfg, work, tokens, size, link)
                beyond = max(0.0, roofline.wire_seconds(one, size, link) - experts)
                waited = roofline.wire_seconds(work.waited(), size, link)
                assert exposed == pytest.approx(waited + cfg.num_layers * beyond)
                assert waited <= exposed <= roofline.wire_seconds(work, size, link)
    # NVLink hides the dense all-reduce behind the experts; PCIe's is slower than them at 16
    work = roofline.denoise_step(cfg, 16, 2, sharded_sampler=True)
    tokens = 16 * roofline.CANVAS
    waited = roofline.wire_seconds(work.waited(), 2, nvlink)
    assert roofline.exposed_seconds(cfg, work, tokens, 2, nvlink) == waited
    assert roofline.exposed_seconds(cfg, work, tokens, 2, pcie) > roofline.wire_seconds(
        work.waited(), 2, pcie
    )
    # the goal: TP=2 over NVLink at 16 canvases within 0.6 of one GPU's step
    assert roofline.step_ms(cfg, 16, 2, nvlink, overlap=True) <= 0.6 * 61.4


def test_the_experts_time_is_the_slower_of_their_flops_and_their_weights() -> None:
    cfg = parse_text_config(REAL_26B_A4B_TEXT_CONFIG)
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    # 64 canvases: every expert touched, FLOP-bound; one token: top_k experts' weights
    flops = 2 * 64 * 256 * cfg.top_k_experts * 3 * inter * hidden
    assert roofline.experts_seconds(cfg, 64 * 256, 2) == pytest.approx(flops / 989e12 / 2)
    weights = cfg.top_k_experts * 3 * inter * hidden * 2 + 2 * hidden * 2
    assert roofline.experts_seconds(cfg, 1, 1) == pytest.approx(weights / 3.35e12)
