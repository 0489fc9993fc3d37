"""One command for a lent GPU machine with its image as it is (python3 with CUDA torch and
triton, transformers 5.17, no venv, no network): every test marked gpu, then the GPU benchmark,
inside a time budget; one JSON and one markdown report; a short summary printed last.

    make gpu-check GPU_OUT=$OUT                   # on the GPU machine (loadtest/README.md)
    python3 -m loadtest.gpu.check --dry-run       # the same flow on CPU, under a minute

1. Wheels: the *.whl files in --wheels (default wheels/, when there) are installed with
   `pip install --no-index --no-deps --target` into a temporary folder put first on
   PYTHONPATH: how transformers >= 5.23 (which builds tiny checkpoints) reaches the image.
2. `pytest -m gpu` over the test files that mark tests gpu (found by their text: collecting
   all of tests/ stops at the server's imports on that image), one JUnit XML for the report;
   with a per-test timeout where pytest-timeout is installed. Without a GPU they skip.
3. `python3 -m loadtest.gpu.bench` (--dry-run in a dry run) with the time left as its budget.

Written into --out: gpu_check.json, gpu_check.md, gpu_tests.log, gpu_tests.xml, gpu_bench.json,
gpu_bench.md, gpu_bench.log (seven files: the device tool brings back at most eight).
Exit status: 0 when no gpu test failed and the benchmark's checks passed, 1 otherwise, 2
without a GPU and without --dry-run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path("gpu-results")
TESTS_TIMEOUT_S = 240  # all gpu tests together
PER_TEST_TIMEOUT_S = 150
BENCH_MIN_S = 150  # the benchmark's share of the budget that the tests may not take
MARGIN_S = 25  # for starting the benchmark and writing the reports
PIP_INSTALL = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run `cmd` with stdout and stderr into `log`; killed after `timeout` seconds (rc 124)."""
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            rc = subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                timeout=max(timeout, 1.0),
                check=False,
            ).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = 124, True
            out.write(f"\n[gpu_check: killed after {timeout:.0f} s]\n")
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }


def install_wheels(wheels: list[Path], env: dict[str, str]) -> dict[str, Any]:
    """Install `wheels` into a fresh folder; `site` is that folder when pip succeeded (pip's
    output goes into the report, `log`)."""
    target = tempfile.mkdtemp(prefix="canvas-wheels-")
    log = Path(target + ".log")
    cmd = [sys.executable, *PIP_INSTALL, "--target", target, *map(str, wheels)]
    result = run_logged(cmd, log, env, timeout=180)
    result["wheels"] = [w.name for w in wheels]
    result["site"] = target if result["rc"] == 0 else None
    result["log"] = log.read_text()[-2000:]
    return result


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test files that mark tests gpu (a decorator or a module-level pytestmark)."""
    files = sorted((root / "tests").rglob("test_*.py"))
    return [str(p.relative_to(root)) for p in files if "mark.gpu" in p.read_text()]


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and cases (name, outcome, seconds, message) from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cases = []
    if not path.is_file():
        return counts | {"cases": cases}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                outcome, message = name, (child.get("message") or child.text or "")[:400]
                break
        counts[outcome] += 1
        module = case.get("classname", "").rsplit(".", 1)[-1]
        cases.append(
            {
                "name": f"{module}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    return counts | {"cases": cases}


def run_tests(out: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    files = gpu_test_files()
    if not files:
        return {"rc": 5, "error": "no test file marks tests gpu", "files": []}
    xml = out / "gpu_tests.xml"
    flags = ["-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={xml}"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, *flags]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    result = run_logged(cmd, out / "gpu_tests.log", env, timeout)
    return result | {"files": files} | parse_junit(xml)


def run_bench(out: Path, env: dict[str, str], dry_run: bool, left: float) -> dict[str, Any]:
    paths = {"json": out / "gpu_bench.json", "markdown": out / "gpu_bench.md"}
    budget = max(left - MARGIN_S, 30.0)
    reports = ["--json", str(paths["json"]), "--markdown", str(paths["markdown"])]
    cmd = [sys.executable, "-m", "loadtest.gpu.bench", *reports, "--budget-s", f"{budget:.0f}"]
    if dry_run:
        cmd.append("--dry-run")
    result = run_logged(cmd, out / "gpu_bench.log", env, timeout=left - 5)
    report = json.loads(paths["json"].read_text()) if paths["json"].is_file() else None
    markdown = paths["markdown"].read_text() if paths["markdown"].is_file() else ""
    return result | {"report": report, "markdown": markdown}


def tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.is_file() else ""


# -- reports -----------------------------------------------------------------------------------


def tests_line(t: dict[str, Any]) -> str:
    if "error" in t:
        return f"tests: {t['error']}"
    timed_out = ", TIMED OUT" if t.get("timed_out") else ""
    return (
        f"tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
        f"{t['skipped']} skipped ({t['seconds']:.0f} s, rc {t['rc']}{timed_out})"
    )


def bench_line(b: dict[str, Any]) -> str:
    timed_out = ", TIMED OUT" if b.get("timed_out") else ""
    report = b.get("report") or {}
    checks = {True: "pass", False: "FAIL"}.get(report.get("checks_pass"), "no report")
    return f"bench: checks {checks} ({b['seconds']:.0f} s, rc {b['rc']}{timed_out})"


def markdown(result: dict[str, Any]) -> str:
    m, t, b = result["meta"], result["tests"], result["bench"]
    lines = [
        f"# GPU check: {'ok' if result['ok'] else 'FAILED'}{' (dry run)' if m['dry_run'] else ''}",
        "",
        f"{m['device']}; Python {m['python']}; {m['seconds']:.0f} s of a {m['budget_s']:.0f} s "
        f"budget. Command: `{m['command']}`.",
    ]
    if result.get("wheels"):
        w = result["wheels"]
        lines += ["", f"Wheels {', '.join(w['wheels'])}: {'installed' if w['site'] else 'FAILED'}"]
    lines += ["", f"## Tests marked gpu: {tests_line(t).removeprefix('tests: ')}", ""]
    if t.get("files"):
        lines += [f"Files: {', '.join(t['files'])}.", ""]
    lines += ["| test | outcome | s | message |", "|---|---|---|---|"]
    for case in t.get("cases", []):
        message = case["message"].replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {case['name']} | {case['outcome']} | {case['seconds']:.1f} | {message} |")
    lines += ["", f"## Benchmark: {bench_line(b).removeprefix('bench: ')}", ""]
    if b.get("markdown"):
        lines.append(b["markdown"].replace("\n## ", "\n### ").replace("# ", "### ", 1))
    else:
        lines += ["No report; the end of gpu_bench.log:", "", "```", b.get("log_tail", ""), "```"]
    return "\n".join(lines) + "\n"


def summary(result: dict[str, Any], out: Path) -> str:
    m, b = result["meta"], result["bench"]
    lines = [
        f"gpu_check{' (dry run)' if m['dry_run'] else ''}: {'ok' if result['ok'] else 'FAILED'} "
        f"in {m['seconds']:.0f} s on {m['device']}",
        f"  {tests_line(result['tests'])}",
        f"  {bench_line(b)}",
    ]
    failed = [
        c["name"] for c in result["tests"].get("cases", []) if c["outcome"] in ("failed", "errors")
    ]
    if failed:
        lines.append(f"  failed: {', '.join(failed)}")
    if (b.get("report") or {}).get("summary"):
        lines.append(b["report"]["summary"])
    lines.append(f"reports: {out / 'gpu_check.json'}, {out / 'gpu_check.md'} (logs beside them)")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python3 -m loadtest.gpu.check",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: the gpu tests skip, the benchmark runs its dry run",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"reports ({RESULTS_DIR})")
    p.add_argument("--budget-s", type=float, default=540.0, help="everything, seconds (540)")
    p.add_argument(
        "--wheels",
        type=Path,
        help="folder of wheels to install first (default: wheels/ when there; none "
        "in a dry run, whose Python may not match the GPU image's)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    began, deadline = time.monotonic(), Deadline(args.budget_s)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; use --dry-run to run the flow on CPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    folder = args.wheels or (None if args.dry_run else ROOT / "wheels")
    wheels = sorted(folder.glob("*.whl")) if folder and folder.is_dir() else []
    installed = install_wheels(wheels, env) if wheels else None
    if installed and installed["site"]:
        paths.insert(0, installed["site"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    tests = run_tests(out, env, min(TESTS_TIMEOUT_S, deadline.left() - BENCH_MIN_S))
    bench = run_bench(out, env, args.dry_run, deadline.left())
    bench["log_tail"] = tail(out / "gpu_bench.log", 30)
    failures = tests.get("failed", 0) + tests.get("errors", 0)
    ok = tests["rc"] == 0 and not failures and bool((bench["report"] or {}).get("checks_pass"))
    result = {
        "meta": {
            "command": " ".join(["python3 -m loadtest.gpu.check", *argv]),
            "dry_run": args.dry_run,
            "device": device,
            "python": platform.python_version(),
            "budget_s": args.budget_s,
            "seconds": time.monotonic() - began,
        },
        "wheels": installed,
        "tests": tests,
        "bench": bench,
        "ok": ok and (installed is None or installed["site"] is not None),
    }
    result["summary"] = summary(result, out)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(tail(out / "gpu_tests.log", 25))
    print(bench["markdown"] or bench["log_tail"])
    print(result["summary"])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
