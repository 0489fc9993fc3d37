"""The set-up the README promises: the Makefile's variables, the package metadata, and one
configuration table that names every `canvas serve` flag and every environment variable the
code reads."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("server", "engine", "kernels", "loadtest", "tests")
# A read of the environment: os.environ.get("X"), os.environ["X"] (not an assignment),
# os.getenv("X"), os.environ.setdefault("X", ...).
ENV_READ = re.compile(
    r"""(?:environ\.get|getenv|environ\.setdefault)\(\s*["']([A-Z0-9_]+)["']"""
    r"""|environ\[\s*["']([A-Z0-9_]+)["']\s*\](?!\s*=[^=])"""
)

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_dry_run(*args: str) -> list[str]:
    """The commands `make -n -B ARGS` would run (-B: as if .venv were being built)."""
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", *args],  # under `make test` too
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


@needs_make
def test_make_serve_passes_args_on_to_canvas_serve():
    lines = make_dry_run("serve", "ARGS=--port 8001 --max-num-seqs 16")
    assert lines[-1] == ".venv/bin/canvas serve --port 8001 --max-num-seqs 16"
    assert make_dry_run("serve")[-1].split() == [".venv/bin/canvas", "serve"]


@needs_make
def test_torch_comes_from_torch_index_only_when_it_is_given():
    cpu = "https://download.pytorch.org/whl/cpu"
    (given,) = [line for line in make_dry_run("venv", f"TORCH_INDEX={cpu}") if "torch==" in line]
    assert given.split()[-2:] == ["--index-url", cpu]
    (default,) = [line for line in make_dry_run("venv") if "torch==" in line]
    assert "--index-url" not in default and default.split()[-1] == "torch==2.13.0"


@needs_make
def test_make_test_prints_the_15_slowest_tests():
    (run,) = [line for line in make_dry_run("test") if "pytest" in line]
    assert "--durations=15" in run.split()


def test_the_license_is_an_spdx_string():
    """A TOML table makes setuptools print deprecation banners at every install."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"


def test_transformers_loads_beside_canvas_kernels_package():
    """transformers 5.25 requires Hugging Face's `kernels` distribution and imports it by that
    top-level name, which is Canvas' own package's: pyproject pins transformers below it. With
    the repository first on the path (as in tests and `canvas` runs), transformers' activations
    (which every model module imports) load and `kernels` is still Canvas'."""
    code = (
        "import kernels, transformers.activations, transformers; "
        "print(kernels.__file__, transformers.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    path, _version = result.stdout.split()
    assert Path(path).resolve() == ROOT / "kernels" / "__init__.py"


def test_a_shadowing_kernels_package_is_named_at_import(tmp_path):
    """Where another top-level `kernels` (Hugging Face's distribution) comes first on the path,
    importing the engine fails at once with an error that names it and the fix."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    result = subprocess.run(
        [sys.executable, "-c", "import engine"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Hugging Face's `kernels` distribution" in result.stderr
    assert "pip uninstall kernels" in result.stderr


def configuration_section() -> str:
    """The configuration reference the README links to (docs/configuration.md)."""
    assert "docs/configuration.md" in (ROOT / "README.md").read_text()
    return (ROOT / "docs" / "configuration.md").read_text()


def test_the_configuration_table_lists_every_serve_flag():
    from server.cli.serve import add_serve_arguments

    serve = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(serve)
    flags = set(re.findall(r"--[a-z][a-z-]*", serve.format_usage()))
    assert {"--model", "--api-key", "--placeholder-model", "--debug"} <= flags
    table = configuration_section()
    rows = {re.match(r"\| `(--[a-z-]+)", line) for line in table.splitlines()}
    assert flags == {m.group(1) for m in rows if m}


def test_the_configuration_table_lists_every_environment_variable_read():
    read = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__):  # its own examples
                continue
            for match in ENV_READ.finditer(path.read_text()):
                read.add(match.group(1) or match.group(2))
    assert {"CANVAS_API_KEY", "CANVAS_CACHE", "TRITON_INTERPRET"} <= read  # the scan works
    table = configuration_section()
    assert {name for name in read if f"`{name}`" not in table} == set()
