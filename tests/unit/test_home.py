"""The suite leaves the user's home alone: tests/conftest.py points HOME, CANVAS_CACHE and the
libraries' caches into a temporary directory per session before anything reads them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import SESSION_ENV, SESSION_HOME

ROOT = Path(__file__).resolve().parents[2]


def test_every_cache_location_is_inside_the_sessions_temporary_home():
    from engine.checkpoints.default import cache_dir

    home = Path(SESSION_HOME)
    assert Path.home() == home and cache_dir().is_relative_to(home)
    for name in SESSION_ENV:
        assert Path(os.environ[name]).is_relative_to(home), name


def test_the_placeholder_model_is_built_in_the_sessions_cache():
    """What a test that builds a checkpoint through `canvas serve` does (run again below in a
    subprocess whose HOME is watched)."""
    from engine.checkpoints.default import cache_dir, placeholder_model_dir

    path = placeholder_model_dir()
    assert path.is_relative_to(cache_dir()) and (path / "config.json").is_file()
    from engine.inputs.tokenizer import Tokenizer

    assert Tokenizer(path).encode("hi")


def test_a_test_run_leaves_home_untouched(tmp_path):
    """A pytest run with HOME set to an empty directory: it builds and loads a checkpoint and
    runs a Triton kernel in the interpreter, and the directory is still empty afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    for name in SESSION_ENV:  # as a fresh shell would have them: unset
        if name != "HOME":
            env.pop(name, None)
    tests = [
        "tests/unit/test_home.py::test_the_placeholder_model_is_built_in_the_sessions_cache",
        "tests/kernels/test_sampler.py::test_entropy_accept_matches_twin[37]",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout, result.stdout[-2000:]
    assert list(home.iterdir()) == []
