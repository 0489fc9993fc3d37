"""The command line's configuration tree (`server.cli.config`): each flag names a field of the
build record, `engine.build.BuildConfig`, takes its default, and maps back onto it."""

from __future__ import annotations

import argparse
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from engine.build import BuildConfig, CheckpointConfig
from engine.engine import EngineConfig
from engine.model.loader import resolve_device
from engine.scheduler import SchedulerConfig
from kernels import BACKENDS
from server.cli.config import (
    CHECKPOINT_FLAGS,
    ENGINE_FLAGS,
    KERNELS,
    add_flags,
    build_config,
    field_value,
    with_field,
    with_threads,
)

FLAGS = (*CHECKPOINT_FLAGS, *ENGINE_FLAGS)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, FLAGS)
    return parser.parse_args(argv)


def test_every_flag_names_a_field_of_the_build_record_and_takes_its_default():
    args, base = parse(), BuildConfig()
    for flag in FLAGS:
        value = field_value(base, flag.path)  # AttributeError: a path that names no field
        assert not is_dataclass(value), f"{flag.name} names a record, not a field"
        if flag.switch is None and flag.name != "--device":
            assert getattr(args, flag.dest) == value, flag.name
    assert args.device == resolve_device("auto")
    assert len({f.path for f in FLAGS}) == len(FLAGS), "one flag per field"


def test_flags_map_back_onto_the_record_and_unset_switches_keep_the_defaults():
    config = build_config(parse(), Path("m"), FLAGS)
    device = resolve_device("auto")
    assert config == BuildConfig(CheckpointConfig(Path("m"), device=device), EngineConfig())
    args = parse(
        *("--max-num-seqs", "3", "--kv-cache-tokens", "512", "--no-prefix-caching"),
        *("--check-invariants", "--exact", "--kernels", "twins", "--adapter", "none"),
    )
    config = build_config(args, None, FLAGS)
    assert config.checkpoint == CheckpointConfig(
        None, device=device, exact=True, kernels="twins", adapter=False
    )
    assert config.engine == EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=3),
        kv_cache_tokens=512,
        prefix_caching=False,
        check_invariants=True,
    )
    # Fields without a flag in the command keep theirs.
    assert build_config(args, None, CHECKPOINT_FLAGS).engine == EngineConfig()


def test_kernel_choices_are_the_kernel_packages_backends():
    parser = argparse.ArgumentParser()
    add_flags(parser, (KERNELS,))
    for backend in BACKENDS:
        assert parser.parse_args(["--kernels", backend]).kernels == backend
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernels", "no-such-backend"])


def test_with_field_rebuilds_the_frozen_records_up_the_path():
    config = BuildConfig()
    changed = with_field(config, "engine.scheduler.max_queue", 7)
    assert changed.engine.scheduler.max_queue == 7 and config == BuildConfig()
    assert [f.name for f in fields(changed)] == ["checkpoint", "engine"]


def test_threads_go_through_the_engines_policy(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(4)))
    assert with_threads(BuildConfig(), None, None).engine.cpu_threads == (3, 4)
    assert with_threads(BuildConfig(), "2", None).engine.cpu_threads == (2,)
    exact = BuildConfig(CheckpointConfig(exact=True))
    assert with_threads(exact, "auto", 4).engine.cpu_threads == (4,)
    with pytest.raises(ValueError, match="--threads must be"):
        with_threads(BuildConfig(), "0", None)
